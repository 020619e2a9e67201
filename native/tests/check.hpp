// The tests' one assertion: reports a failed condition and counts it (the test's exit
// status is the count), so one run shows every failure.
#pragma once

#include <cstdio>

namespace fastload_test {
inline int failures = 0;
}

#define CHECK(cond)                                                                 \
  do {                                                                              \
    if (!(cond)) {                                                                  \
      std::fprintf(stderr, "%s:%d: CHECK(%s) failed\n", __FILE__, __LINE__, #cond); \
      ++fastload_test::failures;                                                    \
    }                                                                               \
  } while (0)
