/*
 * libhpctp_c: the C API of hpctp (see hpctp.h). It embeds Python and forwards every call to
 * hpctp.cli.cbridge; this file only starts/stops the interpreter, converts arguments, wraps the
 * caller's memory without copying, and turns Python exceptions into return codes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hpctp.h"
#include "hpctp_config.h"

enum { STATE_NONE = 0, STATE_INIT = 1, STATE_DONE = 2 };

static char g_error[4096];
static int g_state = STATE_NONE;
static int g_started_python = 0;       /* hpctp_init started the interpreter */
static PyThreadState* g_saved = NULL;  /* the main thread state, released after start-up */
static PyObject* g_capi = NULL;        /* the module hpctp.cli.cbridge */
static int g_ndim = 0;
static int g_dims[HPCTP_MAX_NDIM];
static int g_coords[HPCTP_MAX_NDIM];

static int fail(int code, const char* fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_error, sizeof g_error, fmt, ap);
    va_end(ap);
    return code;
}

const char* hpctp_last_error(void) { return g_error; }

/* With the GIL held and a Python exception set: clear it, store "where: Type: message". */
static int python_error(const char* where)
{
    PyObject* exc;
#if PY_VERSION_HEX >= 0x030C0000
    exc = PyErr_GetRaisedException();
#else
    PyObject *type = NULL, *tb = NULL;
    PyErr_Fetch(&type, &exc, &tb);
    PyErr_NormalizeException(&type, &exc, &tb);
    if (exc != NULL && tb != NULL) PyException_SetTraceback(exc, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
#endif
    if (exc == NULL) return fail(HPCTP_ERR_PYTHON, "%s: unknown Python error", where);
    PyObject* text = PyObject_Str(exc);
    const char* msg = text != NULL ? PyUnicode_AsUTF8(text) : NULL;
    if (msg == NULL) {
        PyErr_Clear();
        msg = "(no message)";
    }
    fail(HPCTP_ERR_PYTHON, "%s: %s: %s", where, Py_TYPE(exc)->tp_name, msg);
    Py_XDECREF(text);
    const char* tbenv = getenv("HPCTP_TRACEBACK");
    if (tbenv != NULL && *tbenv != '\0' && strcmp(tbenv, "0") != 0) {
        PyObject* r = NULL;
        PyObject* mod = PyImport_ImportModule("traceback");
        if (mod != NULL) r = PyObject_CallMethod(mod, "print_exception", "O", exc);
        if (r == NULL) PyErr_Clear();
        Py_XDECREF(r);
        Py_XDECREF(mod);
    }
    Py_DECREF(exc);
    return HPCTP_ERR_PYTHON;
}

/* Collective over comm. Agree on errors found locally before any other communication:
 * returns 0 if no rank failed, else the lowest failing rank's code, with its message in
 * g_error on every rank. */
static int agree(MPI_Comm comm, int rc)
{
    int rank, size, mine, first, code = rc;
    char msg[1024];
    if (MPI_Comm_rank(comm, &rank) != MPI_SUCCESS || MPI_Comm_size(comm, &size) != MPI_SUCCESS)
        return fail(HPCTP_ERR_ARG, "hpctp_init: invalid communicator");
    mine = rc != 0 ? rank : size;
    if (MPI_Allreduce(&mine, &first, 1, MPI_INT, MPI_MIN, comm) != MPI_SUCCESS)
        return fail(HPCTP_ERR_STATE, "hpctp_init: MPI_Allreduce failed");
    if (first == size) return 0;
    if (rank == first) memcpy(msg, g_error, sizeof msg); /* g_error is larger: truncates */
    if (MPI_Bcast(&code, 1, MPI_INT, first, comm) != MPI_SUCCESS ||
        MPI_Bcast(msg, (int)sizeof msg, MPI_CHAR, first, comm) != MPI_SUCCESS)
        return fail(HPCTP_ERR_STATE, "hpctp_init: MPI_Bcast failed");
    msg[sizeof msg - 1] = '\0';
    if (rank != first) fail(code, "%.1023s (reported by rank %d)", msg, first);
    return code;
}

/* Make libpython's symbols global, so that extension modules (numpy, mpi4py) resolve them even
 * when this library was loaded with dlopen(RTLD_LOCAL), e.g. as a plugin. The handle stays open
 * on purpose: libpython stays loaded for the life of the process anyway. */
static void promote_libpython(void)
{
    Dl_info info;
    void* fn = (void*)&Py_InitializeFromConfig;
    if (dladdr(fn, &info) != 0 && info.dli_fname != NULL) {
        void* handle = dlopen(info.dli_fname, RTLD_NOW | RTLD_GLOBAL | RTLD_NOLOAD);
        (void)handle;
    }
}

/* Start the interpreter: the python recorded at build time, or $HPCTP_PYTHON. */
static int start_python(void)
{
    const char* py = getenv("HPCTP_PYTHON");
    if (py == NULL || *py == '\0') py = HPCTP_DEFAULT_PYTHON;
    promote_libpython();
    PyConfig config;
    PyConfig_InitPythonConfig(&config);
    config.install_signal_handlers = 0; /* the simulation owns SIGINT & co. */
    config.parse_argv = 0;
    PyStatus st = PyStatus_Ok();
    /* executable = a venv's bin/python: Python finds pyvenv.cfg next to it and uses the
     * venv's site-packages, as if that python had been run */
    if (*py != '\0') st = PyConfig_SetBytesString(&config, &config.executable, py);
    if (!PyStatus_Exception(st)) st = Py_InitializeFromConfig(&config);
    PyConfig_Clear(&config);
    if (PyStatus_Exception(st))
        return fail(HPCTP_ERR_PYTHON, "hpctp_init: cannot start Python (executable '%s'): %s%s%s", py,
                    st.func != NULL ? st.func : "", st.func != NULL ? ": " : "",
                    st.err_msg != NULL ? st.err_msg : "unknown error");
    g_started_python = 1;
    g_saved = PyEval_SaveThread(); /* release the GIL; every call takes it with PyGILState_Ensure */
    return 0;
}

/* With the GIL held: after a failed import, say which Python was used. */
static int import_error(const char* what)
{
    python_error(what);
    PyObject* exe = PySys_GetObject("executable"); /* borrowed */
    const char* s = exe != NULL && PyUnicode_Check(exe) ? PyUnicode_AsUTF8(exe) : NULL;
    if (s == NULL) PyErr_Clear();
    size_t n = strlen(g_error);
    snprintf(g_error + n, sizeof g_error - n,
             " [Python executable: %s; set HPCTP_PYTHON to the python of the environment where hpctp is "
             "installed]",
             s != NULL ? s : "?");
    return HPCTP_ERR_PYTHON;
}

/* With the GIL held: keep mpi4py off MPI_Init/MPI_Finalize (the caller owns MPI), import hpctp.cli.cbridge. */
static int import_capi(void)
{
    if (g_capi != NULL) return 0;
    if (PyDict_GetItemString(PyImport_GetModuleDict(), "mpi4py.MPI") == NULL) {
        PyObject* mpi4py = PyImport_ImportModule("mpi4py");
        PyObject* rc = mpi4py != NULL ? PyObject_GetAttrString(mpi4py, "rc") : NULL;
        int bad = rc == NULL || PyObject_SetAttrString(rc, "initialize", Py_False) != 0 ||
                  PyObject_SetAttrString(rc, "finalize", Py_False) != 0;
        Py_XDECREF(rc);
        Py_XDECREF(mpi4py);
        if (bad) return import_error("hpctp_init: importing mpi4py");
    }
    g_capi = PyImport_ImportModule("hpctp.cli.cbridge");
    if (g_capi == NULL) return import_error("hpctp_init: importing hpctp.cli.cbridge");
    return 0;
}

/* With the GIL held: hpctp.cli.cbridge.init(fortran_handle, dims), then cache dims and coords. */
static int call_init(MPI_Fint fcomm, const int* dims, int ndim)
{
    int rc = 0;
    PyObject *pydims = NULL, *grid = NULL, *gdims = NULL, *gcoords = NULL;
    if (dims != NULL) {
        pydims = PyTuple_New(ndim);
        for (int d = 0; pydims != NULL && d < ndim; d++) {
            PyObject* v = PyLong_FromLong(dims[d]);
            if (v == NULL) {
                Py_CLEAR(pydims);
                break;
            }
            PyTuple_SET_ITEM(pydims, d, v);
        }
    } else {
        pydims = PyLong_FromLong(ndim);
    }
    if (pydims == NULL) return python_error("hpctp_init");
    grid = PyObject_CallMethod(g_capi, "init", "lO", (long)fcomm, pydims);
    if (grid == NULL) {
        rc = python_error("hpctp_init");
        goto done;
    }
    gdims = PyObject_GetAttrString(grid, "dims");
    gcoords = gdims != NULL ? PyObject_GetAttrString(grid, "coords") : NULL;
    if (gcoords == NULL || !PyTuple_Check(gdims) || !PyTuple_Check(gcoords) || PyTuple_GET_SIZE(gdims) != ndim ||
        PyTuple_GET_SIZE(gcoords) != ndim) {
        if (PyErr_Occurred()) {
            rc = python_error("hpctp_init");
        } else {
            rc = fail(HPCTP_ERR_PYTHON, "hpctp_init: hpctp.cli.cbridge.init returned an unexpected grid");
        }
        goto done;
    }
    for (int d = 0; d < ndim; d++) {
        g_dims[d] = (int)PyLong_AsLong(PyTuple_GET_ITEM(gdims, d));
        g_coords[d] = (int)PyLong_AsLong(PyTuple_GET_ITEM(gcoords, d));
    }
    if (PyErr_Occurred()) {
        rc = python_error("hpctp_init");
        goto done;
    }
    g_ndim = ndim;
done:
    Py_XDECREF(gcoords);
    Py_XDECREF(gdims);
    Py_XDECREF(grid);
    Py_XDECREF(pydims);
    return rc;
}

int hpctp_init(MPI_Comm comm, const int* dims, int ndim)
{
    int flag = 0, rc = 0;
    g_error[0] = '\0';
    if (g_state == STATE_INIT) return fail(HPCTP_ERR_STATE, "hpctp_init: already initialised; call hpctp_finalize first");
    if (g_state == STATE_DONE)
        return fail(HPCTP_ERR_STATE, "hpctp_init: hpctp_finalize shut down the Python interpreter; hpctp cannot "
                                     "be initialised again in this process");
    if (MPI_Initialized(&flag) != MPI_SUCCESS || !flag)
        return fail(HPCTP_ERR_STATE, "hpctp_init: MPI is not initialised (call MPI_Init first)");
    if (MPI_Finalized(&flag) != MPI_SUCCESS || flag)
        return fail(HPCTP_ERR_STATE, "hpctp_init: MPI is already finalised");
    if (comm == MPI_COMM_NULL) return fail(HPCTP_ERR_ARG, "hpctp_init: comm is MPI_COMM_NULL");
    /* local checks and Python start-up; their failures are agreed on before the grid is built */
    if (ndim < 1 || ndim > HPCTP_MAX_NDIM) {
        rc = fail(HPCTP_ERR_ARG, "hpctp_init: ndim=%d must be in 1..%d", ndim, HPCTP_MAX_NDIM);
    } else if (dims != NULL) {
        for (int d = 0; d < ndim && rc == 0; d++)
            if (dims[d] < 0) rc = fail(HPCTP_ERR_ARG, "hpctp_init: dims[%d]=%d is negative", d, dims[d]);
    }
    if (rc == 0 && !Py_IsInitialized()) rc = start_python();
    if (rc == 0) {
        PyGILState_STATE gs = PyGILState_Ensure();
        rc = import_capi();
        PyGILState_Release(gs);
    }
    rc = agree(comm, rc);
    if (rc != 0) return rc;
    PyGILState_STATE gs = PyGILState_Ensure();
    rc = call_init(MPI_Comm_c2f(comm), dims, ndim);
    PyGILState_Release(gs);
    if (rc == 0) g_state = STATE_INIT;
    return rc;
}

int hpctp_init_f(MPI_Fint comm, const int* dims, int ndim) { return hpctp_init(MPI_Comm_f2c(comm), dims, ndim); }

int hpctp_grid(int maxdim, int* ndim, int* dims, int* coords)
{
    g_error[0] = '\0';
    if (g_state != STATE_INIT) return fail(HPCTP_ERR_STATE, "hpctp_grid: not initialised (call hpctp_init first)");
    if (maxdim < g_ndim)
        return fail(HPCTP_ERR_ARG, "hpctp_grid: the grid has %d dims but maxdim=%d", g_ndim, maxdim);
    if (ndim != NULL) *ndim = g_ndim;
    for (int d = 0; d < g_ndim; d++) {
        if (dims != NULL) dims[d] = g_dims[d];
        if (coords != NULL) coords[d] = g_coords[d];
    }
    return 0;
}

/* With the GIL held: a str for a C string (file-system encoding, never fails on bytes), or None. */
static PyObject* str_or_none(const char* s)
{
    if (s == NULL || *s == '\0') Py_RETURN_NONE;
    return PyUnicode_DecodeFSDefault(s);
}

int hpctp_load(const char* model, const char* checkpoint)
{
    int rc = 0;
    g_error[0] = '\0';
    if (g_state != STATE_INIT) return fail(HPCTP_ERR_STATE, "hpctp_load: not initialised (call hpctp_init first)");
    PyGILState_STATE gs = PyGILState_Ensure();
    /* a NULL model is passed as None: Python rejects it collectively */
    PyObject* m = str_or_none(model);
    PyObject* c = m != NULL ? str_or_none(checkpoint) : NULL;
    PyObject* r = c != NULL ? PyObject_CallMethod(g_capi, "load", "OO", m, c) : NULL;
    if (r == NULL) rc = python_error("hpctp_load");
    Py_XDECREF(r);
    Py_XDECREF(c);
    Py_XDECREF(m);
    PyGILState_Release(gs);
    return rc;
}

/* With the GIL held: a tuple of n int64 values (n > 0, p != NULL), or NULL with an exception. */
static PyObject* tuple_i64(const int64_t* p, int n)
{
    PyObject* t = PyTuple_New(n);
    for (int i = 0; t != NULL && i < n; i++) {
        PyObject* v = PyLong_FromLongLong((long long)p[i]);
        if (v == NULL) {
            Py_CLEAR(t);
            break;
        }
        PyTuple_SET_ITEM(t, i, v);
    }
    return t;
}

static PyObject* tuple_int(const int* p, int n)
{
    PyObject* t = PyTuple_New(n);
    for (int i = 0; t != NULL && i < n; i++) {
        PyObject* v = PyLong_FromLong(p[i]);
        if (v == NULL) {
            Py_CLEAR(t);
            break;
        }
        PyTuple_SET_ITEM(t, i, v);
    }
    return t;
}

/* hpctp_infer and hpctp_put: wrap the caller's block (writeable for infer, read-only for put) and hand it to
 * hpctp.cli.cbridge.<method>, which agrees on every error with the other ranks. */
static int block_call(const char* method, const char* where, int flags, void* data, const char* dtype,
                      size_t itemsize, int ndim, const int64_t* local_shape, const int64_t* global_offsets,
                      const int64_t* global_shape, const int* split)
{
    static char empty_block[8]; /* stands for the memory of an empty block passed as NULL */
    char err[512] = "";
    int rc = 0;
    Py_ssize_t count = 1;
    g_error[0] = '\0';
    if (g_state != STATE_INIT) return fail(HPCTP_ERR_STATE, "%s: not initialised (call hpctp_init first)", where);
    /* problems found here are handed to Python, which agrees on them with the other ranks */
    if (ndim < 1 || ndim > HPCTP_MAX_NDIM) {
        snprintf(err, sizeof err, "ndim=%d must be in 1..%d", ndim, HPCTP_MAX_NDIM);
    } else if (local_shape == NULL || global_offsets == NULL || global_shape == NULL) {
        snprintf(err, sizeof err, "%s is NULL",
                 local_shape == NULL ? "local_shape" : global_offsets == NULL ? "global_offsets" : "global_shape");
    } else {
        for (int d = 0; d < ndim && err[0] == '\0'; d++) {
            if (local_shape[d] < 0) {
                snprintf(err, sizeof err, "local_shape[%d]=%lld is negative", d, (long long)local_shape[d]);
            } else if (local_shape[d] > 0 && count > PY_SSIZE_T_MAX / (Py_ssize_t)itemsize / local_shape[d]) {
                snprintf(err, sizeof err, "the block is too large");
            } else {
                count *= (Py_ssize_t)local_shape[d];
            }
        }
        if (err[0] == '\0' && count > 0 && data == NULL)
            snprintf(err, sizeof err, "data is NULL but the block has %lld elements", (long long)count);
    }
    PyGILState_STATE gs = PyGILState_Ensure();
    PyObject *mv = NULL, *ls = NULL, *go = NULL, *gsh = NULL, *sp = NULL, *r = NULL;
    if (err[0] == '\0') {
        char* mem = data != NULL ? (char*)data : empty_block;
        mv = PyMemoryView_FromMemory(mem, count * (Py_ssize_t)itemsize, flags); /* no copy */
        ls = mv != NULL ? tuple_i64(local_shape, ndim) : NULL;
        go = ls != NULL ? tuple_i64(global_offsets, ndim) : NULL;
        gsh = go != NULL ? tuple_i64(global_shape, ndim) : NULL;
        if (gsh != NULL) {
            if (split != NULL) {
                sp = tuple_int(split, ndim);
            } else {
                sp = Py_None;
                Py_INCREF(sp);
            }
        }
        if (sp == NULL) { /* out of memory: still take part, with an error */
            PyErr_Clear();
            snprintf(err, sizeof err, "out of memory converting the arguments");
            Py_CLEAR(mv);
            Py_CLEAR(ls);
            Py_CLEAR(go);
            Py_CLEAR(gsh);
        }
    }
    if (err[0] != '\0') {
        r = PyObject_CallMethod(g_capi, method, "OsOOOOs", Py_None, dtype, Py_None, Py_None, Py_None, Py_None, err);
    } else {
        r = PyObject_CallMethod(g_capi, method, "OsOOOOO", mv, dtype, ls, go, gsh, sp, Py_None);
    }
    if (r == NULL) rc = python_error(where);
    if (mv != NULL) { /* invalidate the view of the caller's memory */
        PyObject* rel = PyObject_CallMethod(mv, "release", NULL);
        if (rel == NULL) PyErr_Clear(); /* still exported; numpy views hold no export: _infer_c counts them */
        Py_XDECREF(rel);
    }
    Py_XDECREF(r);
    Py_XDECREF(sp);
    Py_XDECREF(gsh);
    Py_XDECREF(go);
    Py_XDECREF(ls);
    Py_XDECREF(mv);
    PyGILState_Release(gs);
    return rc;
}

int hpctp_infer(double* data, int ndim, const int64_t* local_shape, const int64_t* global_offsets,
                const int64_t* global_shape, const int* split)
{
    return block_call("_infer_c", "hpctp_infer", PyBUF_WRITE, data, "float64", sizeof(double), ndim, local_shape,
                      global_offsets, global_shape, split);
}

int hpctp_infer_f(float* data, int ndim, const int64_t* local_shape, const int64_t* global_offsets,
                  const int64_t* global_shape, const int* split)
{
    return block_call("_infer_c", "hpctp_infer_f", PyBUF_WRITE, data, "float32", sizeof(float), ndim, local_shape,
                      global_offsets, global_shape, split);
}

/* With the GIL taken: hpctp.cli.cbridge.<method>(args), its error as where's. */
static int call_capi(const char* where, const char* method, PyObject* arg)
{
    int rc = 0;
    PyGILState_STATE gs = PyGILState_Ensure();
    PyObject* r = arg != NULL ? PyObject_CallMethod(g_capi, method, "O", arg) : PyObject_CallMethod(g_capi, method, NULL);
    if (r == NULL) rc = python_error(where);
    Py_XDECREF(r);
    PyGILState_Release(gs);
    return rc;
}

int hpctp_stream_init(const char* config)
{
    int rc;
    g_error[0] = '\0';
    if (g_state != STATE_INIT)
        return fail(HPCTP_ERR_STATE, "hpctp_stream_init: not initialised (call hpctp_init first)");
    PyGILState_STATE gs = PyGILState_Ensure();
    PyObject* c = str_or_none(config); /* NULL or "": None, refused (collectively) by Python */
    PyGILState_Release(gs);
    if (c == NULL) {
        gs = PyGILState_Ensure();
        rc = python_error("hpctp_stream_init");
        PyGILState_Release(gs);
        return rc;
    }
    rc = call_capi("hpctp_stream_init", "stream_init", c);
    gs = PyGILState_Ensure();
    Py_DECREF(c);
    PyGILState_Release(gs);
    return rc;
}

int hpctp_put(const double* data, int ndim, const int64_t* local_shape, const int64_t* global_offsets,
              const int64_t* global_shape, const int* split)
{
    return block_call("_put_c", "hpctp_put", PyBUF_READ, (void*)data, "float64", sizeof(double), ndim, local_shape,
                      global_offsets, global_shape, split);
}

int hpctp_put_f(const float* data, int ndim, const int64_t* local_shape, const int64_t* global_offsets,
                const int64_t* global_shape, const int* split)
{
    return block_call("_put_c", "hpctp_put_f", PyBUF_READ, (void*)data, "float32", sizeof(float), ndim, local_shape,
                      global_offsets, global_shape, split);
}

int hpctp_stream_finalize(void)
{
    g_error[0] = '\0';
    if (g_state != STATE_INIT)
        return fail(HPCTP_ERR_STATE, "hpctp_stream_finalize: not initialised (call hpctp_init first)");
    return call_capi("hpctp_stream_finalize", "stream_finalize", NULL);
}

int hpctp_finalize(void)
{
    int rc = 0;
    g_error[0] = '\0';
    if (g_state == STATE_INIT) {
        PyGILState_STATE gs = PyGILState_Ensure();
        PyObject* r = PyObject_CallMethod(g_capi, "finalize", NULL);
        if (r == NULL) rc = python_error("hpctp_finalize");
        Py_XDECREF(r);
        Py_CLEAR(g_capi);
        PyGILState_Release(gs);
        g_state = STATE_NONE;
        g_ndim = 0;
    }
    if (g_started_python) {
        if (g_capi != NULL) { /* hpctp_init failed after importing hpctp.cli.cbridge */
            PyGILState_STATE gs = PyGILState_Ensure();
            Py_CLEAR(g_capi);
            PyGILState_Release(gs);
        }
        PyEval_RestoreThread(g_saved);
        g_saved = NULL;
        g_started_python = 0;
        g_state = STATE_DONE;
        if (Py_FinalizeEx() < 0 && rc == 0)
            rc = fail(HPCTP_ERR_PYTHON, "hpctp_finalize: Python reported an error while shutting down");
    }
    return rc;
}
