"""Every numeric tolerance of the test suite, named once.

Relative errors are Frobenius norms ``‖approx − exact‖ / ‖exact‖`` against float64 products.
Bands were measured on the data generators in ``tests/data.py`` with margin for seed-to-seed spread.
"""

# Transforms computed in float64 agree with the dense reference to rounding.
FP64_EXACT = 1e-12
# Fast-path float32 versus the float64 reference of the same draw (same noise, same integers up to
# ties at a rounding boundary, each worth one level of 2..8 bits).
FP32_VS_REFERENCE = 1e-3
# Fraction of integer levels allowed to differ from the reference (ties decided differently in fp32).
LEVEL_MISMATCH_FRACTION = 1e-3

# Single-draw bands for HQ grad_input (INT4/INT4, Hadamard) vs the fp64 product.
HQ_GAUSSIAN = 0.40
HQ_LOGNORMAL_PER_TENSOR = 0.80
HQ_LOGNORMAL_PER_TOKEN = 0.35
HQ_OUTLIER = 0.40
# HLA grad_weight (INT8): full rank is quantization error only; rank 8 on token-smooth data, where
# the low-pass basis holds nearly all of the energy (real activations are correlated along tokens).
HLA_FULL_RANK = 0.05
HLA_FULL_RANK_OUTLIER = 0.15
HLA_RANK8_SMOOTH = 0.02
# HLA rank 8 versus its own target, the unquantized low-pass product (quantization error only).
HLA_RANK8_VS_LOWPASS = 0.05

# Unbiasedness: the mean of N draws must reach the exact expectation within this relative error.
UNBIASED_DRAWS = 256
UNBIASED_MEAN = 0.03
SR_DRAWS = 1024
SR_MEAN = 0.012
# Independence of two streams of hash noise: χ² of their joint 32 × 32 histogram (1023 degrees of
# freedom; p ≈ 5e-7 per test, so a dozen tests stay far from a false alarm).
PAIR_CHI2_1023_DOF = 1260

# Reduced-precision inputs: bf16/fp16 grad_output adds its own rounding on top of the INT4 error.
HQ_HALF_PRECISION = 0.45

# End-to-end: every parameter gradient of a compiled model vs eager fp64, per-parameter relative
# error, at full rank or on token-smooth inputs (where rank 8 loses little): INT4 grad_input error
# compounds through the layers below (measured up to 0.36: a LayerNorm below the q/k/v INT4
# grad_input products, 51 tokens).
E2E_GRAD = 0.45

# Training tasks: both backends start from one model and one batch, and HOT changes only the
# backward, so their first losses agree up to Inductor fusing the forward differently.
TASK_FIRST_LOSS_RTOL = 1e-5
