!> Fortran interface to the hpctp C API (capi/hpctp.h), with iso_c_binding.
!>
!>   use hpctp
!>   ierr = hpctp_init(MPI_COMM_WORLD, ndim=2)              ! or dims=[p1, p2]
!>   ierr = hpctp_grid(ndim, dims, coords)                   ! the grid hpctp built
!>   ierr = hpctp_load("hpctp.cli.cbridge:demo_model")              ! optional checkpoint=...
!>   ierr = hpctp_infer(field, local_shape, global_offsets, global_shape)   ! in place
!>   if (ierr /= 0) print *, hpctp_last_error()
!>   ierr = hpctp_stream_init("online.toml")                 ! online training: a trainer in memory
!>   ierr = hpctp_put(field, local_shape, global_offsets, global_shape)     ! each snapshot (copied)
!>   ierr = hpctp_stream_finalize()                          ! the trainer finishes: its checkpoint
!>   ierr = hpctp_finalize()
!>
!> Arrays are in Fortran order: local_shape, global_offsets, global_shape and split have one
!> entry per dimension of the Fortran array (first index fastest); the module reverses them
!> for the row-major C API. Offsets are 0-based (the number of elements before the block).
!> Grid axes keep MPI's numbering (0-based, as in MPI_Cart_coords and hpctp_grid's coords);
!> split(k) is the grid axis dividing array dimension k, -1 for none; without split,
!> dimension k is divided over grid axis k-1 (for k <= grid ndim). The communicator is the
!> Fortran handle (an integer; comm%MPI_VAL with mpi_f08). Every function returns 0 on
!> success; collective calls return the same code on every rank.
module hpctp
  use, intrinsic :: iso_c_binding, only: c_int, c_int64_t, c_double, c_float, c_char, c_ptr, c_size_t, &
                                         c_null_char, c_null_ptr, c_loc, c_f_pointer, c_associated
  implicit none
  private
  public :: hpctp_init, hpctp_grid, hpctp_load, hpctp_infer, hpctp_infer_f, hpctp_finalize, hpctp_last_error
  public :: hpctp_stream_init, hpctp_put, hpctp_put_f, hpctp_stream_finalize

  integer, parameter, public :: HPCTP_MAX_NDIM = 32

  interface
    function c_init_f(comm, dims, ndim) result(ierr) bind(C, name="hpctp_init_f")
      import :: c_int, c_ptr
      integer(c_int), value :: comm
      type(c_ptr), value :: dims
      integer(c_int), value :: ndim
      integer(c_int) :: ierr
    end function
    function c_grid(maxdim, ndim, dims, coords) result(ierr) bind(C, name="hpctp_grid")
      import :: c_int
      integer(c_int), value :: maxdim
      integer(c_int), intent(out) :: ndim
      integer(c_int), intent(out) :: dims(*), coords(*)
      integer(c_int) :: ierr
    end function
    function c_load(model, checkpoint) result(ierr) bind(C, name="hpctp_load")
      import :: c_int, c_char, c_ptr
      character(kind=c_char), intent(in) :: model(*)
      type(c_ptr), value :: checkpoint
      integer(c_int) :: ierr
    end function
    function c_infer(data, ndim, local_shape, global_offsets, global_shape, split) result(ierr) &
        bind(C, name="hpctp_infer")
      import :: c_int, c_int64_t, c_double
      real(c_double), intent(inout) :: data(*)
      integer(c_int), value :: ndim
      integer(c_int64_t), intent(in) :: local_shape(*), global_offsets(*), global_shape(*)
      integer(c_int), intent(in) :: split(*)
      integer(c_int) :: ierr
    end function
    function c_infer_f(data, ndim, local_shape, global_offsets, global_shape, split) result(ierr) &
        bind(C, name="hpctp_infer_f")
      import :: c_int, c_int64_t, c_float
      real(c_float), intent(inout) :: data(*)
      integer(c_int), value :: ndim
      integer(c_int64_t), intent(in) :: local_shape(*), global_offsets(*), global_shape(*)
      integer(c_int), intent(in) :: split(*)
      integer(c_int) :: ierr
    end function
    function c_stream_init(config) result(ierr) bind(C, name="hpctp_stream_init")
      import :: c_int, c_char
      character(kind=c_char), intent(in) :: config(*)
      integer(c_int) :: ierr
    end function
    function c_put(data, ndim, local_shape, global_offsets, global_shape, split) result(ierr) &
        bind(C, name="hpctp_put")
      import :: c_int, c_int64_t, c_double
      real(c_double), intent(in) :: data(*)
      integer(c_int), value :: ndim
      integer(c_int64_t), intent(in) :: local_shape(*), global_offsets(*), global_shape(*)
      integer(c_int), intent(in) :: split(*)
      integer(c_int) :: ierr
    end function
    function c_put_f(data, ndim, local_shape, global_offsets, global_shape, split) result(ierr) &
        bind(C, name="hpctp_put_f")
      import :: c_int, c_int64_t, c_float
      real(c_float), intent(in) :: data(*)
      integer(c_int), value :: ndim
      integer(c_int64_t), intent(in) :: local_shape(*), global_offsets(*), global_shape(*)
      integer(c_int), intent(in) :: split(*)
      integer(c_int) :: ierr
    end function
    function c_stream_finalize() result(ierr) bind(C, name="hpctp_stream_finalize")
      import :: c_int
      integer(c_int) :: ierr
    end function
    function c_finalize() result(ierr) bind(C, name="hpctp_finalize")
      import :: c_int
      integer(c_int) :: ierr
    end function
    function c_last_error() result(p) bind(C, name="hpctp_last_error")
      import :: c_ptr
      type(c_ptr) :: p
    end function
    function c_strlen(s) result(n) bind(C, name="strlen")
      import :: c_ptr, c_size_t
      type(c_ptr), value :: s
      integer(c_size_t) :: n
    end function
  end interface

contains

  !> Collective. Build the process grid on comm (a Fortran handle). dims: grid shape (0 entries
  !> chosen by MPI); or ndim (default 2): a grid chosen entirely by MPI.
  function hpctp_init(comm, dims, ndim) result(ierr)
    integer, intent(in) :: comm
    integer, intent(in), optional :: dims(:)
    integer, intent(in), optional :: ndim
    integer :: ierr
    integer(c_int), target :: cdims(HPCTP_MAX_NDIM)
    integer(c_int) :: n
    n = 2
    if (present(ndim)) n = int(ndim, c_int)
    if (present(dims)) then
      n = int(size(dims), c_int)
      if (n > HPCTP_MAX_NDIM) n = HPCTP_MAX_NDIM + 1  ! rejected (collectively) by the C layer
      cdims(1:min(n, HPCTP_MAX_NDIM)) = int(dims(1:min(n, HPCTP_MAX_NDIM)), c_int)
      ierr = int(c_init_f(int(comm, c_int), c_loc(cdims), n))
    else
      ierr = int(c_init_f(int(comm, c_int), c_null_ptr, n))
    end if
  end function

  !> Local. The grid's number of dims, its dims and this rank's 0-based coordinates.
  function hpctp_grid(ndim, dims, coords) result(ierr)
    integer, intent(out) :: ndim
    integer, intent(out) :: dims(:), coords(:)
    integer :: ierr
    integer(c_int) :: n, cdims(HPCTP_MAX_NDIM), ccoords(HPCTP_MAX_NDIM)
    ndim = 0
    ierr = int(c_grid(int(min(size(dims), size(coords)), c_int), n, cdims, ccoords))
    if (ierr /= 0) return
    ndim = int(n)
    dims(1:ndim) = int(cdims(1:ndim))
    coords(1:ndim) = int(ccoords(1:ndim))
  end function

  !> Collective. Load "package.module:factory", with an optional checkpoint path.
  function hpctp_load(model, checkpoint) result(ierr)
    character(len=*), intent(in) :: model
    character(len=*), intent(in), optional :: checkpoint
    integer :: ierr
    character(kind=c_char, len=:), allocatable, target :: ckpt
    if (present(checkpoint)) then
      ckpt = trim(checkpoint) // c_null_char
      ierr = int(c_load(trim(model) // c_null_char, c_loc(ckpt)))
    else
      ierr = int(c_load(trim(model) // c_null_char, c_null_ptr))
    end if
  end function

  ! Reverse Fortran-order arguments into C order; ndim = 0 when they are inconsistent (the C
  ! layer then reports the error on every rank).
  subroutine to_c_order(local_shape, global_offsets, global_shape, split, n, ls, go, gs, sp)
    integer, intent(in) :: local_shape(:), global_offsets(:), global_shape(:)
    integer, intent(in), optional :: split(:)
    integer(c_int), intent(out) :: n
    integer(c_int64_t), intent(out) :: ls(HPCTP_MAX_NDIM), go(HPCTP_MAX_NDIM), gs(HPCTP_MAX_NDIM)
    integer(c_int), intent(out) :: sp(HPCTP_MAX_NDIM)
    integer :: k, nd, gnd, gdims(HPCTP_MAX_NDIM), gcoords(HPCTP_MAX_NDIM)
    gnd = 0
    ls = 0
    go = 0
    gs = 0
    sp = -1
    nd = size(local_shape)
    n = 0
    if (nd < 1 .or. nd > HPCTP_MAX_NDIM .or. size(global_offsets) /= nd .or. size(global_shape) /= nd) return
    if (present(split)) then
      if (size(split) /= nd) return
    end if
    if (.not. present(split)) then
      if (hpctp_grid(gnd, gdims, gcoords) /= 0) gnd = 0
    end if
    do k = 1, nd
      ls(nd - k + 1) = int(local_shape(k), c_int64_t)
      go(nd - k + 1) = int(global_offsets(k), c_int64_t)
      gs(nd - k + 1) = int(global_shape(k), c_int64_t)
      if (present(split)) then
        sp(nd - k + 1) = int(split(k), c_int)
      else if (k <= gnd) then
        sp(nd - k + 1) = int(k - 1, c_int)
      end if
    end do
    n = int(nd, c_int)
  end subroutine

  !> Collective. Apply the model in place to this rank's float64 block (any rank of array).
  function hpctp_infer(data, local_shape, global_offsets, global_shape, split) result(ierr)
    real(c_double), intent(inout) :: data(*)
    integer, intent(in) :: local_shape(:), global_offsets(:), global_shape(:)
    integer, intent(in), optional :: split(:)
    integer :: ierr
    integer(c_int) :: n, sp(HPCTP_MAX_NDIM)
    integer(c_int64_t) :: ls(HPCTP_MAX_NDIM), go(HPCTP_MAX_NDIM), gs(HPCTP_MAX_NDIM)
    call to_c_order(local_shape, global_offsets, global_shape, split, n, ls, go, gs, sp)
    ierr = int(c_infer(data, n, ls, go, gs, sp))
  end function

  !> Collective. As hpctp_infer, for a float32 block.
  function hpctp_infer_f(data, local_shape, global_offsets, global_shape, split) result(ierr)
    real(c_float), intent(inout) :: data(*)
    integer, intent(in) :: local_shape(:), global_offsets(:), global_shape(:)
    integer, intent(in), optional :: split(:)
    integer :: ierr
    integer(c_int) :: n, sp(HPCTP_MAX_NDIM)
    integer(c_int64_t) :: ls(HPCTP_MAX_NDIM), go(HPCTP_MAX_NDIM), gs(HPCTP_MAX_NDIM)
    call to_c_order(local_shape, global_offsets, global_shape, split, n, ls, go, gs, sp)
    ierr = int(c_infer_f(data, n, ls, go, gs, sp))
  end function

  !> Collective. Start online training: the trainer named (trainer = "package.module:factory") in the
  !> TOML file config, e.g. apps/c_example/online.toml.
  function hpctp_stream_init(config) result(ierr)
    character(len=*), intent(in) :: config
    integer :: ierr
    ierr = int(c_stream_init(trim(config) // c_null_char))
  end function

  !> Collective. Hand the next snapshot (this rank's float64 block, copied) to the trainer; arguments
  !> as hpctp_infer's.
  function hpctp_put(data, local_shape, global_offsets, global_shape, split) result(ierr)
    real(c_double), intent(in) :: data(*)
    integer, intent(in) :: local_shape(:), global_offsets(:), global_shape(:)
    integer, intent(in), optional :: split(:)
    integer :: ierr
    integer(c_int) :: n, sp(HPCTP_MAX_NDIM)
    integer(c_int64_t) :: ls(HPCTP_MAX_NDIM), go(HPCTP_MAX_NDIM), gs(HPCTP_MAX_NDIM)
    call to_c_order(local_shape, global_offsets, global_shape, split, n, ls, go, gs, sp)
    ierr = int(c_put(data, n, ls, go, gs, sp))
  end function

  !> Collective. As hpctp_put, for a float32 block.
  function hpctp_put_f(data, local_shape, global_offsets, global_shape, split) result(ierr)
    real(c_float), intent(in) :: data(*)
    integer, intent(in) :: local_shape(:), global_offsets(:), global_shape(:)
    integer, intent(in), optional :: split(:)
    integer :: ierr
    integer(c_int) :: n, sp(HPCTP_MAX_NDIM)
    integer(c_int64_t) :: ls(HPCTP_MAX_NDIM), go(HPCTP_MAX_NDIM), gs(HPCTP_MAX_NDIM)
    call to_c_order(local_shape, global_offsets, global_shape, split, n, ls, go, gs, sp)
    ierr = int(c_put_f(data, n, ls, go, gs, sp))
  end function

  !> Collective. End the stream: the trainer finishes (its remaining steps, its checkpoint).
  function hpctp_stream_finalize() result(ierr)
    integer :: ierr
    ierr = int(c_stream_finalize())
  end function

  !> Collective. Release the model and grid, stop the interpreter hpctp started.
  function hpctp_finalize() result(ierr)
    integer :: ierr
    ierr = int(c_finalize())
  end function

  !> Local. The last error message on this rank ("" if none).
  function hpctp_last_error() result(msg)
    character(len=:), allocatable :: msg
    type(c_ptr) :: p
    character(kind=c_char), pointer :: s(:)
    integer :: n, i
    p = c_last_error()
    n = 0
    if (c_associated(p)) n = int(c_strlen(p))
    allocate(character(len=n) :: msg)
    if (n == 0) return
    call c_f_pointer(p, s, [n])
    do i = 1, n
      msg(i:i) = s(i)
    end do
  end function

end module hpctp
