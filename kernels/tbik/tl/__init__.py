"""The Triton kernels behind tbik's ops, loaded on the first op that runs on a GPU (or in
Triton's interpreter, see backend.use_interpreter). Each module's functions take inputs the
public op (tbik.matmul, tbik.attention, ...) has already checked."""
