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
# The defaults' INT8 products, with scales per slice along the uncontracted dimensions (HQ: per token
# and per weight column; HLA: per channel of g and of x). Each operand's rounding error has an rms of
# at most s/2 = c·rms/(2·127) per element, c the slice's crest factor (max/rms); two operands give
# a relative product error of at most √2·c/254. c ≤ 4.5 for slices of a few hundred Gaussian or
# Hadamard-mixed values, and per-slice scales keep an outlier channel from raising the others' c:
# 0.025 for every data kind of tests/data.py.
INT8_PER_SLICE_PRODUCT = 0.025
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

# Reduced-precision inputs: bf16 operands carry a relative rounding error of up to 2⁻⁸ per element
# (the product of the rounded operands is ~0.004 from the float64 one) on top of the INT8 error.
HQ_HALF_PRECISION = INT8_PER_SLICE_PRODUCT + 2**-8
# One rounding of a value to bf16 (8 significant bits): the relative error a float32 result cast back to
# bf16 carries, and by which two computations of one function in bf16 and float32 may differ.
BF16_ROUNDING = 2**-8
# The attention backward as products (hot_compile.runtime.attention_ops): each gradient is a float32
# sum of terms of which one factor, P or dS, was rounded to bf16 once, itself rounded to bf16 once.
ATTENTION_PRODUCTS = 2 * BF16_ROUNDING
# A float32 exponential (Cephes' expf polynomial) against float64: a few units in the last place.
FLOAT32_EXP = 4 * 2**-24
# A float32 sum of n exact products: within n units of float32's rounding times the sum of their
# magnitudes (the standard bound, n·u·Σ|aᵢbᵢ|, to first order).
FLOAT32_SUM_PER_TERM = 2**-24

# End-to-end: every parameter gradient of a compiled model (the defaults) vs eager fp64, per-parameter
# relative error. A parameter's gradient carries the error of its own grad_weight product and of
# every grad_input product between it and the loss; independent roundings add in quadrature. The
# test models stack at most 4 rewritten grad_input products above a parameter (a block's fc2, fc1,
# proj, then q/k/v), so √(1 + 4) products' worth (measured: at most 0.019 on a block).
MAX_STACKED_GRAD_INPUTS = 4
E2E_GRAD = INT8_PER_SLICE_PRODUCT * (1 + MAX_STACKED_GRAD_INPUTS) ** 0.5
# With integer forward products too (HotConfig.forward_bits): a gradient then also carries the error of
# the activations it is computed at, which stacks over the same ≤ 4 forward products as E2E_GRAD's
# backward ones; the two add at most linearly.
E2E_GRAD_INT8_FORWARD = 2 * E2E_GRAD
# A 2-layer GPT-2 (tests/test_weight_forms.py): below its embeddings' gradient stand 8 rewritten
# grad_input products (4 Conv1D projections per layer) and the LM head's, 9 in all, and the integer
# forward of as many products: E2E_GRAD_INT8_FORWARD's rule at that depth.
E2E_GRAD_GPT2 = 2 * INT8_PER_SLICE_PRODUCT * (1 + 9) ** 0.5
# The same with rank 8 on token-smooth inputs, where the low-rank cut adds its own small error.
E2E_GRAD_RANK8_SMOOTH = E2E_GRAD + HLA_RANK8_SMOOTH

# HOT's gradient error on a real loss, as a fraction of the mini-batch sampling noise: 0.1 adds at
# most 1% to the variance of the gradient (hot_compile.harness.tasks.gradient_noise).
GRADIENT_ERROR_PER_SAMPLING_NOISE = 0.1

# Training tasks: both backends start from one model and one batch, and HOT with forward_bits=None
# changes only the backward, so their first losses agree up to Inductor fusing the forward differently.
TASK_FIRST_LOSS_RTOL = 1e-5

# Convolutions (groups = 1) over their im2col matrix. grad_input is HQ's product, whose patches the
# fold sums exactly: INT8_PER_SLICE_PRODUCT. grad_weight rounds three operands, not two: the forward
# saves x in int8 (one scale per channel), and the backward quantizes the patches of that x and g;
# three independent roundings of the per-slice rule's size give √(3/2) times its two.
CONV_HLA_PRODUCT = INT8_PER_SLICE_PRODUCT * 1.5**0.5
# A small ResNet-style stack: a parameter's gradient carries its own grad_weight error and those of the
# ≤ MAX_STACKED_GRAD_INPUTS rewritten grad_inputs above it, independent, so in quadrature.
E2E_GRAD_CONV = (CONV_HLA_PRODUCT**2 + MAX_STACKED_GRAD_INPUTS * INT8_PER_SLICE_PRODUCT**2) ** 0.5

# Saved activations (hot_compile.passes.saved_activations). Int8 rows: s = max|row|/127, round to
# nearest, so every value is back within half a level, max|row|/254. A few float32 roundings (the
# cast, the division, the product with the scale) add at most this much relative to the row's max.
HALF_INT8_LEVEL = 1 / 254
FP32_ROUNDINGS = 4 * 2**-24
# The 4-bit code of GELU's derivative: each value within one step of its row's range, which is at
# most 1.13 + 0.17 = 1.3 over 2⁴ − 2 = 14 steps; against a derivative of rms ≥ 0.5 (inputs of unit
# scale), a gradient through it is off by at most 0.093 / 0.5 relative. The int8 rows of the other
# saved values add 1/254 each, within that margin.
E2E_GRAD_SAVED_CODES = (1.3 / 14) / 0.5
# A derivative the encoder computes (cpu_encode.cpp), in float32: GELU's and its tanh form's, each a
# polynomial of degree 6 on every sixteenth of [0, 6) (interpolated in float64, far more exactly than
# float32 holds) and 1 past it. Horner's rule rounds six products and six sums, each by at most half
# an ulp of a term up to 1.13 (6·10⁻⁸); on the test's dense grid they add to 1.4·10⁻⁷ (GELU) and
# 1.3·10⁻⁷ (tanh form).
DERIVATIVE_EVALUATION = 4e-7
