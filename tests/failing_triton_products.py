"""Stands for llama_core.triton_products where its kernels cannot be built (a triton too old, say): a module of
its own, as that one is, so that its frames are the products' code (llama_core.quantize.failed_in_triton) and
a test's are not."""

MAX_ROWS = 64


def int8_product(x, weight, scales):
    raise RuntimeError("the kernel could not be built")


int8_rows_product = int8_product
