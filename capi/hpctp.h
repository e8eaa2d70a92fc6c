/*
 * hpctp C API: run a hpctp model (Python) on the blocks of a distributed field held by a
 * simulation written in C, C++ or Fortran, in place and without copies.
 *
 *   MPI_Init(...);                                  // the simulation owns MPI
 *   hpctp_init(MPI_COMM_WORLD, dims, 2);            // embeds Python, builds the process grid
 *   hpctp_load("hpctp.cli.cbridge:demo_model", NULL);      // "package.module:factory", checkpoint path
 *   hpctp_infer(field, 2, local_shape, offsets, global_shape, NULL);   // collective, in place
 *   hpctp_stream_init("online.toml");               // online training: a trainer in memory
 *   hpctp_put(field, 2, local_shape, offsets, global_shape, NULL);     // each snapshot (copied)
 *   hpctp_stream_finalize();                        // the trainer finishes: its checkpoint
 *   hpctp_finalize();
 *   MPI_Finalize();
 *
 * Conventions
 *   - Every function returns 0 on success and non-zero on error; hpctp_last_error() then
 *     gives the message (the Python exception as "Type: message"). A Python error never
 *     terminates the program.
 *   - "Collective" functions must be called by every rank of the communicator given to
 *     hpctp_init. Errors that only some ranks can see (a NULL pointer, wrong offsets, a
 *     missing file, an exception in the model) are agreed on: every rank returns non-zero,
 *     with the message of the lowest failing rank, so no rank is left waiting.
 *   - Arrays are row-major (C order: the last index varies fastest). Offsets are 0-based.
 *   - The process grid: grid rank == rank in the communicator, coordinates row-major
 *     (rank = c[0]*dims[1]*... + c[ndim-1]). The block held by the rank at grid coordinates
 *     c must be block c[split[d]] along each split dimension d. Blocks may be uneven.
 *   - Python: the interpreter recorded at build time (the venv's python) is used, unless the
 *     environment variable HPCTP_PYTHON names another python executable (of the same
 *     Python version; a venv's bin/python works). If the process already runs Python
 *     (e.g. the library is called via ctypes), that interpreter is used.
 *   - Not thread-safe: call from one thread (the one that calls MPI).
 */
#ifndef HPCTP_H
#define HPCTP_H

#include <stdint.h>

#include <mpi.h>

#ifdef __cplusplus
extern "C" {
#endif

/* hpctp's version (setup.cfg's; CMake stops at configure time where these differ from it). */
#define HPCTP_VERSION_MAJOR 0
#define HPCTP_VERSION_MINOR 2
#define HPCTP_VERSION_PATCH 0
#define HPCTP_MAX_NDIM 32

/* Error codes (all errors: non-zero). */
#define HPCTP_OK 0
#define HPCTP_ERR_PYTHON 1 /* a Python exception (collectively agreed where it matters) */
#define HPCTP_ERR_STATE 2  /* called in the wrong state (not initialised, already finalised, ...) */
#define HPCTP_ERR_ARG 3    /* invalid argument found before any communication */

/* Collective over comm. Start Python if needed and build the process grid on (a duplicate
 * of) comm. MPI must be initialised by the caller and is never finalised by hpctp.
 *   dims: grid shape of ndim entries (0 entries: chosen by MPI), or NULL: an ndim-D grid
 *         chosen entirely by MPI (MPI_Dims_create).
 *   ndim: 1..HPCTP_MAX_NDIM.
 * Calling it again before hpctp_finalize is an error. After hpctp_finalize shut down the
 * Python interpreter that hpctp started, hpctp cannot be initialised again in this process. */
int hpctp_init(MPI_Comm comm, const int* dims, int ndim);

/* As hpctp_init, with the communicator's Fortran handle (MPI_Comm_c2f); used by the
 * Fortran module. */
int hpctp_init_f(MPI_Fint comm, const int* dims, int ndim);

/* Local. The grid's ndim (<= maxdim), its dims and this rank's coordinates (either array
 * may be NULL). */
int hpctp_grid(int maxdim, int* ndim, int* dims, int* coords);

/* Collective. Load the model used by hpctp_infer.
 *   model: "package.module:factory"; factory(grid, checkpoint) returns a callable mapping a
 *          hpctp.DistTensor to one of the same layout. "hpctp.cli.cbridge:demo_model" is a built-in
 *          test model: y = 2 x + mean(x) over the global field.
 *   checkpoint: a path handed to the factory, or NULL / "" for none.
 * A failing load leaves no model loaded. */
int hpctp_load(const char* model, const char* checkpoint);

/* Collective. Apply the model to the distributed field in place: data (this rank's block,
 * row-major, local_shape[0] x ... x local_shape[ndim-1] values) is wrapped without copying
 * and overwritten with the result.
 *   global_offsets: global index of the block's first element per dim; must agree with the
 *                   block sizes in grid order (checked: a clear error otherwise).
 *   global_shape:   shape of the global field (the same on every rank).
 *   split:          grid axis dividing each dim, -1 for a dim that is not divided; NULL:
 *                   dim d over grid axis d for d < grid ndim, the others not divided.
 * data may be NULL when the block is empty. On error the data are unchanged (unless the
 * model itself wrote to its input). */
int hpctp_infer(double* data, int ndim, const int64_t* local_shape, const int64_t* global_offsets,
                const int64_t* global_shape, const int* split);

/* Collective. As hpctp_infer, for float32 data. */
int hpctp_infer_f(float* data, int ndim, const int64_t* local_shape, const int64_t* global_offsets,
                  const int64_t* global_shape, const int* split);

/* Online training: the simulation's snapshots go to a trainer in memory (no file), co-located on the
 * ranks of hpctp_init (between the simulation's steps, on its own blocks).
 *
 * Collective. Start the trainer that the TOML file config names at its top level
 * (trainer = "package.module:factory", e.g. "apps.surrogate.online:capi_trainer"); the factory reads
 * the file's other sections (see capi/README.md). */
int hpctp_stream_init(const char* config);

/* Collective. Hand the next snapshot to the trainer: this rank's block (arguments as hpctp_infer's),
 * copied, so the simulation may change it on return; the trainer may then train a few steps. Every
 * snapshot of a stream has the blocks of the first one. */
int hpctp_put(const double* data, int ndim, const int64_t* local_shape, const int64_t* global_offsets,
              const int64_t* global_shape, const int* split);

/* Collective. As hpctp_put, for float32 data. */
int hpctp_put_f(const float* data, int ndim, const int64_t* local_shape, const int64_t* global_offsets,
                const int64_t* global_shape, const int* split);

/* Collective. End the stream: the trainer runs the steps its snapshots allow and writes its checkpoint
 * (safe when no stream is open; hpctp_finalize calls it for a stream left open). */
int hpctp_stream_finalize(void);

/* Collective. Drop the model, free the grid, and shut down the Python interpreter if
 * hpctp_init started it. Safe to call when not initialised (returns 0). Call it before
 * MPI_Finalize. */
int hpctp_finalize(void);

/* Local. The message of the last error on this rank ("" if none); valid until the next
 * hpctp call. */
const char* hpctp_last_error(void);

#ifdef __cplusplus
}
#endif

#endif /* HPCTP_H */
