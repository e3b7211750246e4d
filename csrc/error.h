// Internal: the thread-local error message behind kvb_last_error().
#ifndef KVBRIDGE_ERROR_H
#define KVBRIDGE_ERROR_H

#include <string>

#include "kvbridge/status.h"

namespace kvb {

// Records `message` as this thread's last error and returns `status`.
int fail(int status, const std::string& message);

// Formats like printf, records, returns `status`.
int failf(int status, const char* fmt, ...) __attribute__((format(printf, 2, 3)));

}  // namespace kvb

// Wraps the body of a C entry point: any exception becomes KVB_ERR_INTERNAL.
#define KVB_GUARD_BEGIN try {
#define KVB_GUARD_END                                                                 \
  }                                                                                   \
  catch (const std::bad_alloc&) {                                                     \
    return ::kvb::fail(KVB_ERR_INTERNAL, "out of host memory");                       \
  }                                                                                   \
  catch (const std::exception& e) {                                                   \
    return ::kvb::fail(KVB_ERR_INTERNAL, std::string("internal error: ") + e.what()); \
  }                                                                                   \
  catch (...) {                                                                       \
    return ::kvb::fail(KVB_ERR_INTERNAL, "internal error: unknown exception");        \
  }

#endif  // KVBRIDGE_ERROR_H
