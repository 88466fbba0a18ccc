"""The values the launch settings take, one list each: the build profile, ``LaunchConfig`` and every
command's --help read them from here (no imports: `trtedge --help` stays light)."""

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
WEIGHTS = ("auto", "float", "bf16", "fp32", "int8", "int4", "fp8")  # how the weights are stored and run
LOAD_FORMATS = ("auto", "dummy")
KV_CACHE_DTYPES = ("auto", "fp8", "fp16", "int8")  # auto: the model's activation dtype; fp16, int8: the CPU's
