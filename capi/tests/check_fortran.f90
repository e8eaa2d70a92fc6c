! The Fortran module under mpiexec (driven by tests/test_capi.py): a Fortran-ordered 2-D field
! cut over hpctp's 2-D grid, the demo model (y = 2x + mean(x)) applied in place, checked here.
! Prints per rank:  fortran coords=<c1>,<c2> init=<rc> maxerr=<e> maxerrf=<e> bad=<rc> msg=<...>
! and  fortran stream put=<rc> init=<rc> final=<rc> put_msg=<...> init_msg=<...>  (the online-training
! bindings: a put before hpctp_stream_init, a missing config file, a finalize with no stream open)
program check_fortran
  use, intrinsic :: iso_c_binding, only: c_int, c_double, c_float
  use hpctp
  implicit none
  interface
    function check_mpi_init() result(r) bind(C, name="check_mpi_init")
      import :: c_int
      integer(c_int) :: r
    end function
    function check_world_f() result(r) bind(C, name="check_world_f")
      import :: c_int
      integer(c_int) :: r
    end function
    function check_mpi_finalize() result(r) bind(C, name="check_mpi_finalize")
      import :: c_int
      integer(c_int) :: r
    end function
  end interface
  integer, parameter :: gshape(2) = [11, 6]
  integer :: ierr, rc_init, rc_bad, rc_before, ndim, dims(4), coords(4), lo(2), n(2), i, j, k
  integer :: rc_put, rc_stream, rc_final
  real(c_double), allocatable :: x(:, :)
  real(c_float), allocatable :: xf(:, :)
  real(c_double) :: dummy(1), mean, maxerr, maxerrf, want
  character(len=:), allocatable :: before_msg, bad_msg, put_msg, stream_msg

  dummy = 0
  rc_before = hpctp_infer(dummy, [1], [0], [1])
  before_msg = hpctp_last_error()
  if (check_mpi_init() /= 0) stop 1
  rc_init = hpctp_init(int(check_world_f()), ndim=2)
  if (rc_init /= 0) then
    print '(2a)', 'fortran init failed: ', hpctp_last_error()
    stop 1
  end if
  ierr = hpctp_grid(ndim, dims, coords)
  do k = 1, 2  ! array dim k over grid axis k-1 (the module's default split)
    lo(k) = gshape(k) * coords(k) / dims(k)
    n(k) = gshape(k) * (coords(k) + 1) / dims(k) - lo(k)
  end do
  allocate(x(n(1), n(2)), xf(n(1), n(2)))
  do j = 1, n(2)
    do i = 1, n(1)
      x(i, j) = f(lo(1) + i - 1, lo(2) + j - 1)
    end do
  end do
  xf = real(x, c_float)
  mean = 0
  do j = 0, gshape(2) - 1
    do i = 0, gshape(1) - 1
      mean = mean + f(i, j)
    end do
  end do
  mean = mean / (gshape(1) * gshape(2))

  ierr = hpctp_load("hpctp.cli.cbridge:demo_model")
  if (ierr == 0) ierr = hpctp_infer(x, n, lo, gshape)
  if (ierr == 0) ierr = hpctp_infer_f(xf, n, lo, gshape, split=[0, 1])
  if (ierr /= 0) print '(2a)', 'fortran error: ', hpctp_last_error()
  maxerr = -1
  maxerrf = -1
  if (ierr == 0) then
    maxerr = 0
    maxerrf = 0
    do j = 1, n(2)
      do i = 1, n(1)
        want = 2 * f(lo(1) + i - 1, lo(2) + j - 1) + mean
        maxerr = max(maxerr, abs(x(i, j) - want))
        maxerrf = max(maxerrf, abs(real(xf(i, j), c_double) - want))
      end do
    end do
  end if
  ! the grid axes swapped: the blocks no longer tile (or the offsets disagree): an error everywhere
  rc_bad = hpctp_infer(x, n, lo, gshape, split=[1, 0])
  bad_msg = hpctp_last_error()
  print '(a,i0,a,i0,a,i0,a,es10.3,a,es10.3,a,i0,a,i0,4a)', 'fortran coords=', coords(1), ',', coords(2), &
    ' init=', rc_init, ' maxerr=', maxerr, ' maxerrf=', maxerrf, ' bad=', rc_bad, ' before=', rc_before, &
    ' before_msg=', before_msg, ' bad_msg=', bad_msg
  rc_put = hpctp_put(x, n, lo, gshape)
  put_msg = hpctp_last_error()
  rc_stream = hpctp_stream_init("/nonexistent/online.toml")
  stream_msg = hpctp_last_error()
  rc_final = hpctp_stream_finalize()
  print '(a,i0,a,i0,a,i0,4a)', 'fortran stream put=', rc_put, ' init=', rc_stream, ' final=', rc_final, &
    ' put_msg=', put_msg, ' init_msg=', stream_msg
  ierr = hpctp_finalize()
  if (check_mpi_finalize() /= 0) stop 1

contains

  pure function f(i, j) result(v)
    integer, intent(in) :: i, j
    real(c_double) :: v
    v = sin(0.1d0 * i) * cos(0.07d0 * j) + 0.001d0 * i * j - 0.5d0
  end function

end program check_fortran
