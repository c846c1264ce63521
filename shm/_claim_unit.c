/* shm._claim as one translation unit. Its files are split by concern for the
 * reader; compiled as one, the compiler inlines across them (the key hash and
 * the grant run once a key on the claim path), with any C compiler and no
 * link-time optimisation. setup.py builds this file. */
#include "_claim.c"
#include "_grant.c"
#include "_complete.c" /* after _grant.c: it uses its lookup and swaps */
#include "_blake2b.c"
#include "_owners.c" /* after _blake2b.c: it hashes the keys */
#include "_claim_path.c"
#include "_claim_take.c"
#include "_claim_grant.c"
#include "_claim_rows.c" /* after _claim_grant.c: it uses its run helpers */
#include "_claim_sqlite.c"
#include "_claim_walk.c"
