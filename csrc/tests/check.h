/* check.h: the assertion macro of the C unit tests: reports a failed
 * condition with a printf-style message and counts it, so that one run shows
 * every failure (up to 20) and main() can return nonzero. */
#ifndef REPROP_TESTS_CHECK_H
#define REPROP_TESTS_CHECK_H

#include <stdio.h>

static int failures = 0;

#define CHECK(cond, ...)                                                                            \
    do {                                                                                            \
        if (!(cond)) {                                                                              \
            if (failures++ > 20)                                                                    \
                break;                                                                              \
            fprintf(stderr, "%s:%d: CHECK(%s) failed: ", __FILE__, __LINE__, #cond);               \
            fprintf(stderr, __VA_ARGS__);                                                           \
            fputc('\n', stderr);                                                                    \
        }                                                                                           \
    } while (0)

#endif /* REPROP_TESTS_CHECK_H */
