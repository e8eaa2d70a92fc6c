/*
 * Error paths of the hpctp C API under mpiexec (driven by tests/test_capi.py).
 *
 * Each step prints one line per rank:   step=<name> rank=<r> rc=<rc> msg=<hpctp_last_error()>
 * and the test checks every rank's rc and message. Errors that only some ranks see must come
 * back on every rank (no hang, no crash), and the API must keep working after them.
 * The last steps run the demo model and print the largest deviation from y = 2x + mean(x)
 * computed here in C:  value rank=<r> maxerr=<e> n=<elements>
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <mpi.h>

#include "hpctp.h"

static int g_rank;

static int step(const char* name, int rc)
{
    printf("step=%s rank=%d rc=%d msg=%s\n", name, g_rank, rc, rc != 0 ? hpctp_last_error() : "");
    fflush(stdout);
    return rc;
}

int main(int argc, char** argv)
{
    int size, ndim = 0, dims[4] = {0}, coords[4] = {0};
    if (MPI_Init(&argc, &argv) != MPI_SUCCESS) return 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);

    /* 1-D field of N values over a 1-D grid chosen by hpctp; balanced blocks */
    const int64_t N = 50;
    int64_t gshape[1] = {N}, offs[1] = {0}, lshape[1] = {0};
    double* x = NULL;

    step("infer_before_init", hpctp_infer(NULL, 1, lshape, offs, gshape, NULL));
    int bad_dims[2] = {size + 1, 1};
    step("init_bad_dims", hpctp_init(MPI_COMM_WORLD, bad_dims, 2));
    step("init_bad_ndim", hpctp_init(MPI_COMM_WORLD, NULL, g_rank == size - 1 ? 0 : 1)); /* one rank only */
    if (step("init", hpctp_init(MPI_COMM_WORLD, NULL, 1))) goto out;
    step("init_twice", hpctp_init(MPI_COMM_WORLD, NULL, 1));
    step("grid", hpctp_grid(4, &ndim, dims, coords));
    printf("grid rank=%d ndim=%d dims=%d coords=%d\n", g_rank, ndim, dims[0], coords[0]);

    offs[0] = N * coords[0] / dims[0];
    lshape[0] = N * (coords[0] + 1) / dims[0] - offs[0];
    x = malloc((size_t)(lshape[0] > 0 ? lshape[0] : 1) * sizeof *x);
    if (x == NULL) MPI_Abort(MPI_COMM_WORLD, 1);
    for (int64_t i = 0; i < lshape[0]; i++) x[i] = (double)((offs[0] + i) * (offs[0] + i) % 17) - 3.0;

    step("infer_no_model", hpctp_infer(x, 1, lshape, offs, gshape, NULL));
    step("load_no_module", hpctp_load("hpctp_no_such_module:factory", NULL));
    step("load_bad_spec", hpctp_load(g_rank == 0 ? "hpctp.cli.cbridge" : "hpctp.cli.cbridge:demo_model", NULL)); /* rank 0 only */
    step("load_no_attr", hpctp_load("hpctp.cli.cbridge:no_such_factory", NULL));
    step("load_missing_checkpoint", hpctp_load("hpctp.cli.cbridge:demo_model", "/nonexistent/ckpt.npy"));
    if (step("load", hpctp_load("hpctp.cli.cbridge:demo_model", NULL))) goto finalize;

    /* wrong offsets on the last rank only: every rank must get the error */
    int64_t wrong[1] = {offs[0] + (g_rank == size - 1 ? 1 : 0)};
    step("infer_bad_offsets", hpctp_infer(x, 1, lshape, wrong, gshape, NULL));
    /* NULL local_shape on rank 0 only */
    step("infer_null_shape", hpctp_infer(x, 1, g_rank == 0 ? NULL : lshape, offs, gshape, NULL));
    /* blocks that do not add up to the global shape */
    int64_t big[1] = {N + 1};
    step("infer_bad_global_shape", hpctp_infer(x, 1, lshape, offs, big, NULL));
    /* a split that names no grid axis */
    const int bad_split[1] = {3};
    step("infer_bad_split", hpctp_infer(x, 1, lshape, offs, gshape, bad_split));
    /* ndim differs on rank 0 */
    step("infer_bad_ndim", hpctp_infer(x, g_rank == 0 ? 0 : 1, lshape, offs, gshape, NULL));

    /* the data are untouched by the failed calls; now a good call, checked here in C */
    double local = 0.0, mean = 0.0, maxerr = 0.0;
    for (int64_t i = 0; i < lshape[0]; i++) local += x[i];
    if (MPI_Allreduce(&local, &mean, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD) != MPI_SUCCESS) MPI_Abort(MPI_COMM_WORLD, 1);
    mean /= (double)N;
    if (step("infer", hpctp_infer(x, 1, lshape, offs, gshape, NULL)) == 0) {
        for (int64_t i = 0; i < lshape[0]; i++) {
            double want = 2.0 * ((double)((offs[0] + i) * (offs[0] + i) % 17) - 3.0) + mean;
            double e = fabs(x[i] - want);
            if (e > maxerr || e != e) maxerr = e;
        }
        printf("value rank=%d maxerr=%.3e n=%lld\n", g_rank, maxerr, (long long)lshape[0]);
    }
finalize:
    step("finalize", hpctp_finalize());
    step("finalize_again", hpctp_finalize());
    step("init_after_finalize", hpctp_init(MPI_COMM_WORLD, NULL, 1));
    step("load_after_finalize", hpctp_load("hpctp.cli.cbridge:demo_model", NULL));
out:
    free(x);
    MPI_Finalize();
    return 0;
}
