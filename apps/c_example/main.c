/*
 * c_example: an MPI simulation code in C that runs a hpctp model on its own field.
 *
 * The "simulation" owns a 2-D global field of NX x NY values, cut into blocks of its own
 * (uneven) sizes over a 2-D process grid, and fills it with a known function of the global
 * indices. It then hands its blocks to hpctp (in place, no copies) and writes the result.
 *
 *   mpiexec -n 4 c_example OUT_DIR [MODEL [CHECKPOINT]]
 *
 *   OUT_DIR     every rank writes OUT_DIR/rank<r>.bin: int64 header {offset0, offset1,
 *               n0, n1, NX, NY}, then n0*n1 float64 results (hpctp_infer), then n0*n1
 *               float32 results (hpctp_infer_f), all row-major, native byte order.
 *   MODEL       "package.module:factory" (default hpctp.cli.cbridge:demo_model: y = 2x + mean(x)).
 *   CHECKPOINT  path for the factory (default: none).
 * Rank 0 also prints the global sum of the float64 result ("checksum ...").
 *
 * C_EXAMPLE_CHANNELS=C (environment, C >= 1): a multi-channel state instead, as the trained
 * surrogate expects (C=2, e.g. MODEL apps.surrogate.inference:factory, CHECKPOINT
 * out/run/checkpoint.h5): the field is [C, CX, CY] (sizes divisible by 8, for U-Nets with up
 * to 3 poolings) with split {-1, 0, 1} (channels whole, H and W cut as above), filled with
 * Gray-Scott-like values (channel 0 in [0.5, 1], the others in [0, 0.3]). The header is the
 * same ({offset0, offset1, n0, n1, CX, CY}: the spatial block) and each result holds
 * C*n0*n1 values, [C, n0, n1] row-major.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <mpi.h>

#include "hpctp.h"

enum { NX = 37, NY = 23, CX = 40, CY = 24, MAX_CHANNELS = 64 };

/* The simulation's own decomposition: cut c of n items into p parts with triangular weights
 * (part c gets about (c+1)/(1+2+...+p) of the items), deliberately not hpctp's balanced one. */
static int64_t cut(int64_t n, int p, int c) { return n * c * (c + 1) / ((int64_t)p * (p + 1)); }

/* The initial field, a function of the global indices (tests recompute it with numpy). */
static double field(int64_t i, int64_t j) { return sin(0.1 * (double)i) * cos(0.07 * (double)j) + 0.001 * (double)(i * j) - 0.5; }

/* The multi-channel state (C_EXAMPLE_CHANNELS): smooth, in [0, 1]. */
static double state(int c, int64_t i, int64_t j)
{
    double s = 0.5 + 0.5 * sin(0.2 * (double)i + 0.7 * c) * cos(0.15 * (double)j - 0.3 * c);
    return c == 0 ? 1.0 - 0.5 * s : 0.3 * s;
}

static int report(int rank, const char* what, int rc)
{
    if (rc != 0) fprintf(stderr, "c_example rank %d: %s failed (%d): %s\n", rank, what, rc, hpctp_last_error());
    return rc;
}

int main(int argc, char** argv)
{
    int rank = 0, size = 1, status = 1;
    double *x = NULL, sum = 0.0, total = 0.0;
    float* xf = NULL;
    FILE* f = NULL;
    if (MPI_Init(&argc, &argv) != MPI_SUCCESS) return 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (argc < 2) {
        if (rank == 0) fprintf(stderr, "usage: %s OUT_DIR [MODEL [CHECKPOINT]]\n", argv[0]);
        MPI_Finalize();
        return 2;
    }
    const char* outdir = argv[1];
    const char* model = argc > 2 ? argv[2] : "hpctp.cli.cbridge:demo_model";
    const char* checkpoint = argc > 3 ? argv[3] : NULL;
    int nc = 0; /* channels; 0: the plain 2-D field */
    const char* env = getenv("C_EXAMPLE_CHANNELS");
    if (env != NULL && *env != '\0') {
        char* end = NULL;
        long v = strtol(env, &end, 10);
        if (*end != '\0' || v < 1 || v > MAX_CHANNELS) {
            if (rank == 0) fprintf(stderr, "c_example: C_EXAMPLE_CHANNELS=%s must be in 1..%d\n", env, MAX_CHANNELS);
            MPI_Finalize();
            return 2;
        }
        nc = (int)v;
    }
    const int ndim = nc > 0 ? 3 : 2, b = 3 - ndim; /* [C, H, W] arrays, passed from index b */
    const int64_t gx = nc > 0 ? CX : NX, gy = nc > 0 ? CY : NY, nch = nc > 0 ? nc : 1;

    /* 2-D process grid: row-major ranks, as hpctp requires */
    int dims[2] = {0, 0};
    if (MPI_Dims_create(size, 2, dims) != MPI_SUCCESS) goto done;
    int coords[2] = {rank / dims[1], rank % dims[1]};
    int64_t gshape[3] = {nc, gx, gy}, offs[3] = {0, 0, 0}, lshape[3] = {nc, 0, 0};
    const int split[3] = {-1, 0, 1}; /* channels whole, H over grid axis 0, W over grid axis 1 */
    for (int d = 1; d < 3; d++) {
        offs[d] = cut(gshape[d], dims[d - 1], coords[d - 1]);
        lshape[d] = cut(gshape[d], dims[d - 1], coords[d - 1] + 1) - offs[d];
    }
    const int64_t n0 = lshape[1], n1 = lshape[2], o0 = offs[1], o1 = offs[2];
    size_t n = (size_t)(nch * n0 * n1);
    x = malloc((n > 0 ? n : 1) * sizeof *x);
    xf = malloc((n > 0 ? n : 1) * sizeof *xf);
    if (x == NULL || xf == NULL) {
        fprintf(stderr, "c_example rank %d: out of memory\n", rank);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    for (int64_t c = 0; c < nch; c++)
        for (int64_t i = 0; i < n0; i++)
            for (int64_t j = 0; j < n1; j++) {
                double v = nc > 0 ? state((int)c, o0 + i, o1 + j) : field(o0 + i, o1 + j);
                x[(c * n0 + i) * n1 + j] = v;
                xf[(c * n0 + i) * n1 + j] = (float)v;
            }

    /* hpctp: every call is collective and returns the same code on every rank */
    const int64_t *ls = lshape + b, *os = offs + b, *gs = gshape + b;
    const int* sp = split + b; /* 2-D: {0, 1}, dim 0 over grid axis 0, dim 1 over grid axis 1 */
    if (report(rank, "hpctp_init", hpctp_init(MPI_COMM_WORLD, dims, 2))) goto done;
    if (report(rank, "hpctp_load", hpctp_load(model, checkpoint))) goto finalize;
    if (report(rank, "hpctp_infer", hpctp_infer(x, ndim, ls, os, gs, sp))) goto finalize;
    if (report(rank, "hpctp_infer_f", hpctp_infer_f(xf, ndim, ls, os, gs, sp))) goto finalize;
    status = 0;
finalize:
    if (report(rank, "hpctp_finalize", hpctp_finalize())) status = 1;
    if (status != 0) goto done;

    char path[4096];
    snprintf(path, sizeof path, "%s/rank%d.bin", outdir, rank);
    f = fopen(path, "wb");
    int64_t header[6] = {o0, o1, n0, n1, gx, gy};
    if (f == NULL || fwrite(header, sizeof header[0], 6, f) != 6 || fwrite(x, sizeof *x, n, f) != n ||
        fwrite(xf, sizeof *xf, n, f) != n) {
        fprintf(stderr, "c_example rank %d: cannot write %s\n", rank, path);
        status = 1;
    }
    if (f != NULL && fclose(f) != 0) status = 1;
    for (size_t k = 0; k < n; k++) sum += x[k];
    if (MPI_Reduce(&sum, &total, 1, MPI_DOUBLE, MPI_SUM, 0, MPI_COMM_WORLD) != MPI_SUCCESS) status = 1;
    if (rank == 0 && nc > 0)
        printf("c_example: %d ranks, grid %dx%d, field %dx%dx%d, checksum %.17g\n", size, dims[0], dims[1], nc,
               (int)gx, (int)gy, total);
    else if (rank == 0)
        printf("c_example: %d ranks, grid %dx%d, field %dx%d, checksum %.17g\n", size, dims[0], dims[1], NX, NY, total);
done:
    free(x);
    free(xf);
    MPI_Finalize();
    return status;
}
