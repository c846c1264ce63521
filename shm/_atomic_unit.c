/* shm._atomic as one translation unit. Its files are split by concern for the
 * reader; compiled as one, the compiler inlines across them, with any C
 * compiler and no link-time optimisation. setup.py builds this file. */
#include "_atomic.c"
#include "_atomic_scan.c"
#include "_atomic_excluded.c"
#include "_atomic_seq.c"
