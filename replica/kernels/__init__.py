"""The CPU's C++ kernels, each a `.cpp` source beside the Python wrapper that builds it once for
this CPU (`build`, which reads what this CPU is from `protocol.cpu`) and says whether it is
`available`. Where a kernel cannot be built the model keeps to torch's operators."""
