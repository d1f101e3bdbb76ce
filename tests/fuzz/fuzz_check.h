// What a fuzz target asserts about an input its parser accepted. A failed check prints
// the condition and aborts, which libFuzzer reports as a crash and saves the input.
#pragma once

#include <cstdio>
#include <cstdlib>

#define FULCRUM_FUZZ_CHECK(condition)                                                   \
  do {                                                                                  \
    if (!(condition)) {                                                                 \
      std::fprintf(stderr, "%s:%d: FULCRUM_FUZZ_CHECK failed: %s\n", __FILE__, __LINE__, \
                   #condition);                                                         \
      std::abort();                                                                     \
    }                                                                                   \
  } while (0)
