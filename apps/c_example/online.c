/*
 * c_online: a Gray-Scott simulation in C that trains hpctp's surrogate while it runs (online training,
 * no file in between), then runs the trained surrogate on its own final state.
 *
 *   mpiexec -n 4 c_online CONFIG OUT_DIR CHECKPOINT
 *
 *   CONFIG   TOML file for hpctp_stream_init (apps/c_example/online.toml): trainer =
 *            "apps.surrogate.online:capi_trainer", and [simulation] describing what this program
 *            simulates (size, steps, warmup, snapshot_every: the constants below), [surrogate],
 *            [train] (out: where the checkpoint goes) and [online].
 *   OUT_DIR  every rank writes OUT_DIR/rank<r>.bin: int64 header {offset0, offset1, n0, n1, H, W},
 *            then its block of the final state [2, n0, n1] (float64, row-major: u then v), then the
 *            trained surrogate's prediction from it (hpctp_infer, same layout).
 *   CHECKPOINT the checkpoint the trainer writes (train.out of CONFIG, /checkpoint.h5), loaded for
 *            the prediction.
 *
 * The simulation owns its state: u and v on an H x W periodic grid, cut into blocks of its own
 * (uneven) sizes over a 2-D process grid, a halo of one cell exchanged with MPI_Sendrecv every step,
 * explicit Euler. Every SNAPSHOT_EVERY steps after WARMUP it hands its block to hpctp_put (copied: the
 * simulation goes on; the trainer, on the same ranks, trains the steps the snapshot allows). After
 * the last step, hpctp_stream_finalize finishes the training and writes the checkpoint (train.out of
 * CONFIG), which hpctp_load + hpctp_infer then run on the live blocks.
 * Rank 0 prints "c_online: ... snapshots N ..." and the checksum of the prediction.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <mpi.h>

#include "hpctp.h"

/* the simulation: keep in step with [simulation] of CONFIG */
enum { H = 24, W = 20, STEPS = 300, WARMUP = 60, SNAPSHOT_EVERY = 20 };
static const double DU = 0.16, DV = 0.08, FEED = 0.035, KILL = 0.065, DT = 1.0;

/* The simulation's own decomposition: cut c of n items into p parts with triangular weights. */
static int64_t cut(int64_t n, int p, int c) { return n * c * (c + 1) / ((int64_t)p * (p + 1)); }

static int report(int rank, const char* what, int rc)
{
    if (rc != 0) fprintf(stderr, "c_online rank %d: %s failed (%d): %s\n", rank, what, rc, hpctp_last_error());
    return rc;
}

/* Periodic distance between two indices of a dimension of size n. */
static int64_t pdist(int64_t a, int64_t b, int64_t n)
{
    int64_t d = a > b ? a - b : b - a;
    return d < n - d ? d : n - d;
}

int main(int argc, char** argv)
{
    int rank = 0, size = 1, status = 1;
    if (MPI_Init(&argc, &argv) != MPI_SUCCESS) return 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (argc < 4) {
        if (rank == 0) fprintf(stderr, "usage: %s CONFIG OUT_DIR CHECKPOINT\n", argv[0]);
        MPI_Finalize();
        return 2;
    }
    const char *config = argv[1], *outdir = argv[2], *ckpt = argv[3];

    /* 2-D process grid (row-major ranks, as hpctp requires), periodic neighbours */
    int dims[2] = {0, 0};
    MPI_Dims_create(size, 2, dims);
    const int c0 = rank / dims[1], c1 = rank % dims[1];
    const int up = ((c0 + dims[0] - 1) % dims[0]) * dims[1] + c1, down = ((c0 + 1) % dims[0]) * dims[1] + c1;
    const int left = c0 * dims[1] + (c1 + dims[1] - 1) % dims[1], right = c0 * dims[1] + (c1 + 1) % dims[1];
    const int64_t o0 = cut(H, dims[0], c0), o1 = cut(W, dims[1], c1);
    const int64_t n0 = cut(H, dims[0], c0 + 1) - o0, n1 = cut(W, dims[1], c1 + 1) - o1;
    const int64_t m0 = n0 + 2, m1 = n1 + 2; /* with the halo */
    const size_t n = (size_t)(n0 * n1);

    /* u, v with halo; the block handed to hpctp: [2, n0, n1] without halo */
    double* u = calloc((size_t)(m0 * m1), sizeof *u);
    double* v = calloc((size_t)(m0 * m1), sizeof *v);
    double* un = calloc((size_t)(m0 * m1), sizeof *un);
    double* vn = calloc((size_t)(m0 * m1), sizeof *vn);
    double* block = malloc(2 * (n > 0 ? n : 1) * sizeof *block);
    double* colbuf = malloc(4 * (size_t)(n0 > 0 ? n0 : 1) * sizeof *colbuf);
    if (u == NULL || v == NULL || un == NULL || vn == NULL || block == NULL || colbuf == NULL) {
        fprintf(stderr, "c_online rank %d: out of memory\n", rank);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
#define AT(a, i, j) (a)[((i) + 1) * m1 + (j) + 1]
    /* initial state: u = 1, v = 0, three square patches (u = 0.5, v = 0.25) at fixed places */
    const int64_t patch[3][2] = {{H / 4, W / 3}, {H / 2 + 2, 3 * W / 4}, {3 * H / 4 + 1, W / 5}};
    for (int64_t i = 0; i < n0; i++)
        for (int64_t j = 0; j < n1; j++) {
            AT(u, i, j) = 1.0;
            for (int p = 0; p < 3; p++)
                if (pdist(o0 + i, patch[p][0], H) <= 2 && pdist(o1 + j, patch[p][1], W) <= 2) {
                    AT(u, i, j) = 0.5;
                    AT(v, i, j) = 0.25;
                }
        }

    int64_t gshape[3] = {2, H, W}, offs[3] = {0, o0, o1}, lshape[3] = {2, n0, n1};
    const int split[3] = {-1, 0, 1}; /* channels whole, H over grid axis 0, W over grid axis 1 */
    if (report(rank, "hpctp_init", hpctp_init(MPI_COMM_WORLD, dims, 2))) goto done;
    if (report(rank, "hpctp_stream_init", hpctp_stream_init(config))) goto finalize;

    int snapshots = 0;
    for (int step = 0; step <= STEPS; step++) {
        if (step >= WARMUP && (step - WARMUP) % SNAPSHOT_EVERY == 0) { /* a snapshot: to the trainer */
            for (int64_t i = 0; i < n0; i++)
                for (int64_t j = 0; j < n1; j++) {
                    block[i * n1 + j] = AT(u, i, j);
                    block[n + (size_t)(i * n1 + j)] = AT(v, i, j);
                }
            if (report(rank, "hpctp_put", hpctp_put(block, 3, lshape, offs, gshape, split))) goto finalize;
            snapshots++;
        }
        if (step == STEPS) break;
        /* halo: rows with the neighbours above and below, then columns (rows contiguous, columns packed) */
        double* f[2] = {u, v};
        for (int k = 0; k < 2; k++) {
            double* a = f[k];
            MPI_Sendrecv(&AT(a, 0, 0), (int)n1, MPI_DOUBLE, up, 0, &AT(a, n0, 0), (int)n1, MPI_DOUBLE, down, 0,
                         MPI_COMM_WORLD, MPI_STATUS_IGNORE);
            MPI_Sendrecv(&AT(a, n0 - 1, 0), (int)n1, MPI_DOUBLE, down, 1, &AT(a, -1, 0), (int)n1, MPI_DOUBLE, up, 1,
                         MPI_COMM_WORLD, MPI_STATUS_IGNORE);
            for (int64_t i = 0; i < n0; i++) {
                colbuf[i] = AT(a, i, 0);
                colbuf[n0 + i] = AT(a, i, n1 - 1);
            }
            MPI_Sendrecv(colbuf, (int)n0, MPI_DOUBLE, left, 2, colbuf + 2 * n0, (int)n0, MPI_DOUBLE, right, 2,
                         MPI_COMM_WORLD, MPI_STATUS_IGNORE);
            MPI_Sendrecv(colbuf + n0, (int)n0, MPI_DOUBLE, right, 3, colbuf + 3 * n0, (int)n0, MPI_DOUBLE, left, 3,
                         MPI_COMM_WORLD, MPI_STATUS_IGNORE);
            for (int64_t i = 0; i < n0; i++) {
                AT(a, i, n1) = colbuf[2 * n0 + i];
                AT(a, i, -1) = colbuf[3 * n0 + i];
            }
        }
        for (int64_t i = 0; i < n0; i++)
            for (int64_t j = 0; j < n1; j++) {
                double uc = AT(u, i, j), vc = AT(v, i, j), uvv = uc * vc * vc;
                double lu = AT(u, i - 1, j) + AT(u, i + 1, j) + AT(u, i, j - 1) + AT(u, i, j + 1) - 4.0 * uc;
                double lv = AT(v, i - 1, j) + AT(v, i + 1, j) + AT(v, i, j - 1) + AT(v, i, j + 1) - 4.0 * vc;
                AT(un, i, j) = uc + DT * (DU * lu + (FEED * (1.0 - uc) - uvv));
                AT(vn, i, j) = vc + DT * (DV * lv + (uvv - (FEED + KILL) * vc));
            }
        double* t = u;
        u = un;
        un = t;
        t = v;
        v = vn;
        vn = t;
    }
    if (report(rank, "hpctp_stream_finalize", hpctp_stream_finalize())) goto finalize;

    /* the trained surrogate on the final state, in place on a copy */
    double* pred = malloc(2 * (n > 0 ? n : 1) * sizeof *pred);
    if (pred == NULL) MPI_Abort(MPI_COMM_WORLD, 1);
    memcpy(pred, block, 2 * n * sizeof *pred);
    if (report(rank, "hpctp_load", hpctp_load("apps.surrogate.inference:factory", ckpt))) goto free_pred;
    if (report(rank, "hpctp_infer", hpctp_infer(pred, 3, lshape, offs, gshape, split))) goto free_pred;
    char path[4096];
    snprintf(path, sizeof path, "%s/rank%d.bin", outdir, rank);
    FILE* f = fopen(path, "wb");
    int64_t header[6] = {o0, o1, n0, n1, H, W};
    int ok = f != NULL && fwrite(header, sizeof header[0], 6, f) == 6 && fwrite(block, sizeof *block, 2 * n, f) == 2 * n &&
             fwrite(pred, sizeof *pred, 2 * n, f) == 2 * n;
    if (f != NULL && fclose(f) != 0) ok = 0;
    if (!ok) fprintf(stderr, "c_online rank %d: cannot write %s\n", rank, path);
    double sum = 0.0, total = 0.0;
    for (size_t k = 0; k < 2 * n; k++) sum += pred[k];
    MPI_Reduce(&sum, &total, 1, MPI_DOUBLE, MPI_SUM, 0, MPI_COMM_WORLD);
    if (rank == 0)
        printf("c_online: %d ranks, grid %dx%d, field 2x%dx%d, snapshots %d, prediction checksum %.17g\n", size, dims[0],
               dims[1], H, W, snapshots, total);
    status = ok ? 0 : 1;
free_pred:
    free(pred);
finalize:
    if (report(rank, "hpctp_finalize", hpctp_finalize())) status = 1;
done:
    free(u);
    free(v);
    free(un);
    free(vn);
    free(block);
    free(colbuf);
    MPI_Finalize();
    return status;
#undef AT
}
