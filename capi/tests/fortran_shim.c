/* MPI calls for check_fortran.f90, so that it needs no MPI Fortran bindings. */
#include <stddef.h>

#include <mpi.h>

int check_mpi_init(void);
int check_world_f(void);
int check_mpi_finalize(void);

int check_mpi_init(void) { return MPI_Init(NULL, NULL); }
int check_world_f(void) { return (int)MPI_Comm_c2f(MPI_COMM_WORLD); }
int check_mpi_finalize(void) { return MPI_Finalize(); }
