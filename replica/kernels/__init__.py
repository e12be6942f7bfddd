"""The CPU's C++ kernels, each a `.cpp` source beside the Python wrapper that builds it once for
this CPU (`build`) and says whether it is `available`; and what this CPU is (`cpu`). Where a
kernel cannot be built the model keeps to torch's operators."""
