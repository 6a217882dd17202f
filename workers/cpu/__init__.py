"""CPU decode acceleration: native Q8_0/Q4_0 kernels, a fused decode step, thread placement."""
