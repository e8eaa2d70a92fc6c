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
 *   MODEL       "package.module:factory" (default hpctp.capi:demo_model: y = 2x + mean(x)).
 *   CHECKPOINT  path for the factory (default: none).
 * Rank 0 also prints the global sum of the float64 result ("checksum ...").
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <mpi.h>

#include "hpctp.h"

enum { NX = 37, NY = 23 };

/* The simulation's own decomposition: cut c of n items into p parts with triangular weights
 * (part c gets about (c+1)/(1+2+...+p) of the items), deliberately not hpctp's balanced one. */
static int64_t cut(int64_t n, int p, int c) { return n * c * (c + 1) / ((int64_t)p * (p + 1)); }

/* The initial field, a function of the global indices (tests recompute it with numpy). */
static double field(int64_t i, int64_t j) { return sin(0.1 * (double)i) * cos(0.07 * (double)j) + 0.001 * (double)(i * j) - 0.5; }

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
    const char* model = argc > 2 ? argv[2] : "hpctp.capi:demo_model";
    const char* checkpoint = argc > 3 ? argv[3] : NULL;

    /* 2-D process grid: row-major ranks, as hpctp requires */
    int dims[2] = {0, 0};
    if (MPI_Dims_create(size, 2, dims) != MPI_SUCCESS) goto done;
    int coords[2] = {rank / dims[1], rank % dims[1]};
    int64_t gshape[2] = {NX, NY};
    int64_t offs[2], lshape[2];
    for (int d = 0; d < 2; d++) {
        offs[d] = cut(gshape[d], dims[d], coords[d]);
        lshape[d] = cut(gshape[d], dims[d], coords[d] + 1) - offs[d];
    }
    size_t n = (size_t)(lshape[0] * lshape[1]);
    x = malloc((n > 0 ? n : 1) * sizeof *x);
    xf = malloc((n > 0 ? n : 1) * sizeof *xf);
    if (x == NULL || xf == NULL) {
        fprintf(stderr, "c_example rank %d: out of memory\n", rank);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    for (int64_t i = 0; i < lshape[0]; i++)
        for (int64_t j = 0; j < lshape[1]; j++) {
            double v = field(offs[0] + i, offs[1] + j);
            x[i * lshape[1] + j] = v;
            xf[i * lshape[1] + j] = (float)v;
        }

    /* hpctp: every call is collective and returns the same code on every rank */
    const int split[2] = {0, 1}; /* dim 0 over grid axis 0, dim 1 over grid axis 1 */
    if (report(rank, "hpctp_init", hpctp_init(MPI_COMM_WORLD, dims, 2))) goto done;
    if (report(rank, "hpctp_load", hpctp_load(model, checkpoint))) goto finalize;
    if (report(rank, "hpctp_infer", hpctp_infer(x, 2, lshape, offs, gshape, split))) goto finalize;
    if (report(rank, "hpctp_infer_f", hpctp_infer_f(xf, 2, lshape, offs, gshape, split))) goto finalize;
    status = 0;
finalize:
    if (report(rank, "hpctp_finalize", hpctp_finalize())) status = 1;
    if (status != 0) goto done;

    char path[4096];
    snprintf(path, sizeof path, "%s/rank%d.bin", outdir, rank);
    f = fopen(path, "wb");
    int64_t header[6] = {offs[0], offs[1], lshape[0], lshape[1], NX, NY};
    if (f == NULL || fwrite(header, sizeof header[0], 6, f) != 6 || fwrite(x, sizeof *x, n, f) != n ||
        fwrite(xf, sizeof *xf, n, f) != n) {
        fprintf(stderr, "c_example rank %d: cannot write %s\n", rank, path);
        status = 1;
    }
    if (f != NULL && fclose(f) != 0) status = 1;
    for (size_t k = 0; k < n; k++) sum += x[k];
    if (MPI_Reduce(&sum, &total, 1, MPI_DOUBLE, MPI_SUM, 0, MPI_COMM_WORLD) != MPI_SUCCESS) status = 1;
    if (rank == 0) printf("c_example: %d ranks, grid %dx%d, field %dx%d, checksum %.17g\n", size, dims[0], dims[1], NX, NY, total);
done:
    free(x);
    free(xf);
    MPI_Finalize();
    return status;
}
