// Internal: a small process-wide pool of worker threads for the CPU copy.
#ifndef KVBRIDGE_THREAD_POOL_H
#define KVBRIDGE_THREAD_POOL_H

#include <functional>

namespace kvb {

// Runs fn(0) ... fn(n - 1), fn(0) on the calling thread, the others on pool
// workers (started on first use, at most n - 1 of them), and returns when all
// are done.  Safe to call from several threads at once; fork-aware (a child
// process gets a fresh pool).  fn must not throw.
void parallel_for(int n, const std::function<void(int)>& fn);

}  // namespace kvb

#endif  // KVBRIDGE_THREAD_POOL_H
