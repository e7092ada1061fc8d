/* OpenMP's worker threads. GNU libgomp keeps a pool of workers for every thread that has run a parallel
 * region, and once the pools together hold more threads than the machine has cores, every wait at every
 * region's start and end sleeps at once instead of spinning: each of a decode step's few dozen regions then
 * pays for waking its workers. A model loaded in one thread and served from another leaves two pools. */
#include <stddef.h>

#if defined(_OPENMP)
/* OpenMP 5.0's, where the runtime has it (weak: a runtime without it leaves this null). */
extern int omp_pause_resource_all(int kind) __attribute__((weak));
#define OMP_PAUSE_SOFT 1
#endif

/* Ends the worker threads of the calling thread's pool (the next region it runs starts new ones): 0 when
 * done, nonzero where the runtime cannot (or the kernels run without OpenMP). */
int release_openmp_workers(void) {
#if defined(_OPENMP)
  if (omp_pause_resource_all != NULL) return omp_pause_resource_all(OMP_PAUSE_SOFT);
#endif
  return -1;
}
