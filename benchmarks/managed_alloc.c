/* A torch CUDAPluggableAllocator that hands out CUDA managed memory, which the CPU can read
 * and write too. benchmarks/gpu_check.sh builds it (nvcc -shared) when the machine's MPI is not
 * CUDA-aware; tests/test_device_blocks.py then allocates torch and cupy device blocks from
 * managed memory (HPCTP_TEST_MANAGED_ALLOC=<the .so>) and hands them to that MPI directly, so
 * hpctp's CUDA-aware path (no staging) runs on a GPU even without a CUDA-aware MPI library. */
#include <stddef.h>
#include <sys/types.h>
#include <cuda_runtime_api.h>

void *hpctp_managed_malloc(ssize_t size, int device, cudaStream_t stream) {
  void *p = NULL;
  int current = device;
  (void)stream;
  cudaGetDevice(&current);
  if (current != device) cudaSetDevice(device);
  if (cudaMallocManaged(&p, size > 0 ? (size_t)size : 1, cudaMemAttachGlobal) != cudaSuccess) p = NULL;
  if (current != device) cudaSetDevice(current);
  return p;
}

void hpctp_managed_free(void *ptr, ssize_t size, int device, cudaStream_t stream) {
  (void)size;
  (void)device;
  (void)stream;
  cudaFree(ptr);
}
