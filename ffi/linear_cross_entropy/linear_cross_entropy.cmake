# The vocabulary chunks' products run cuBLASLt through the shared plan cache
# (ffi/common/blas/).
jaxgpu_cuda_link_libraries(jaxgpu_cublaslt)
