"""The OpenMP worker threads that torch's CPU operations and the kernels share (threads.c: why they matter)."""

from .build import load


def release_workers() -> bool:
    """Ends the OpenMP worker threads that the calling thread's parallel regions started (loading a model
    starts some), for when another thread takes over the model's work; whether they were ended (False where
    the kernels are not built or the OpenMP runtime cannot)."""
    library = load()
    return library is not None and library.release_openmp_workers() == 0
