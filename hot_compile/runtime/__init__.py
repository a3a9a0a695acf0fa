"""What the rewritten graphs run: the Hadamard transforms and quantizers (``hadamard``, ``quant``), the
integer GEMMs (``int8_gemm``), HOT's custom ops (``ops``) with their aten implementation
(``aten_impl``) and CPU kernels (``cpu_kernels``), and the device profiles the cost model prices them
with (``devices``). Nothing here imports the config, the pass or the API."""
