"""C++ kernels for the CPU (XLA FFI custom calls), compiled on first use; a leaf like
pallas_kernels: plain arrays in, no jaxinfer imports."""
