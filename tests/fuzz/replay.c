/* replay.c - runs a fuzz target without libFuzzer, so that every build and CI run exercises it:
 * over each file of its corpus (the directory argv[1], when it exists), then over 20,000
 * inputs made from a fixed seed: random bytes, and the target's valid inputs (sl_fuzz_seed)
 * and corpus files mutated by bit flips, interesting values, truncations, insertions,
 * deletions and splices. A crash is the failure the sanitizers report.
 *
 * `TARGET --write-seeds DIR` writes the target's valid inputs to DIR: the corpus's seeds.
 * $SUBLET_FUZZ_INPUTS sets how many inputs are made (longer runs when asked; for real fuzzing,
 * build with -DSUBLET_FUZZ=ON and clang: libFuzzer).
 */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz.h"

#define RANDOM_INPUTS 20000
#define INPUT_CAP ((size_t)1 << 17)
#define MAX_BASES 256

/* The valid inputs that mutations start from; the list owns the copies. */
struct bases {
  uint8_t *data[MAX_BASES];
  size_t len[MAX_BASES];
  size_t n;
};

struct tally {
  int passed, failed;
};

static uint64_t rng_state = 0x5eed5b17c0ffee11u;

static uint64_t rng(void) {
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return rng_state;
}

static size_t rng_below(size_t n) {
  return n > 0 ? (size_t)(rng() % n) : 0;
}

static void bases_add(struct bases *b, const uint8_t *data, size_t len) {
  if (b->n == MAX_BASES)
    return;
  b->data[b->n] = malloc(len + 1);
  memcpy(b->data[b->n], data, len);
  b->len[b->n++] = len;
}

static void bases_free(struct bases *b) {
  for (size_t i = 0; i < b->n; i++)
    free(b->data[i]);
}

/* Runs the target on an exactly sized copy, so that reading past the input is caught. */
static void run_one(const uint8_t *data, size_t len, struct tally *t) {
  uint8_t *copy = malloc(len + 1);
  int rc;

  memcpy(copy, data, len);
  rc = LLVMFuzzerTestOneInput(copy, len);
  free(copy);
  if (rc == 0 || rc == -1)
    t->passed++;
  else
    t->failed++;
}

static size_t read_file(const char *path, uint8_t *buf, size_t cap) {
  FILE *f = fopen(path, "rb");
  size_t n;

  if (f == NULL)
    return 0;
  n = fread(buf, 1, cap, f);
  fclose(f);
  return n;
}

static void run_corpus(const char *dir, uint8_t *buf, struct bases *b, struct tally *t) {
  DIR *d = opendir(dir);
  struct dirent *e;
  char path[4096];

  if (d == NULL)
    return;
  while ((e = readdir(d)) != NULL) {
    if (e->d_name[0] == '.')
      continue;
    snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
    size_t len = read_file(path, buf, INPUT_CAP);
    run_one(buf, len, t);
    bases_add(b, buf, len);
  }
  closedir(d);
}

/* ------------------------------------------------------------------ mutations */

static const uint32_t interesting[] = {0, 1, 2, 3, 0x7f, 0xff, 253, 254, 0xffff,
                                       (32u << 20), (32u << 20) + 1, 0x7fffffff, 0xffffffff,
                                       0x534c4254};

static size_t mutate_once(uint8_t *buf, size_t len, const struct bases *b) {
  size_t at = rng_below(len + 1), n = 1 + rng_below(16);
  uint32_t v = interesting[rng_below(sizeof(interesting) / sizeof(interesting[0]))];
  size_t other = rng_below(b->n);

  switch (rng() % 8) {
    case 0: /* bit flip */
      if (at < len)
        buf[at] ^= (uint8_t)(1u << (rng() % 8));
      return len;
    case 1: /* interesting value, little-endian, as the protocol writes numbers */
      for (size_t i = 0; i < 4 && at + i < len; i++)
        buf[at + i] = (uint8_t)(v >> (8 * i));
      return len;
    case 2: /* truncation */
      return at;
    case 3: /* insertion of random bytes */
      n = len + n <= INPUT_CAP ? n : 0;
      memmove(buf + at + n, buf + at, len - at);
      for (size_t i = 0; i < n; i++)
        buf[at + i] = (uint8_t)rng();
      return len + n;
    case 4: /* deletion */
      n = at + n <= len ? n : len - at;
      memmove(buf + at, buf + at + n, len - at - n);
      return len - n;
    case 5: /* duplication of a piece */
      n = at + n <= len && len + n <= INPUT_CAP ? n : 0;
      memmove(buf + at + n, buf + at, len - at);
      return len + n;
    default: /* splice: the tail from another valid input */
      if (b->n == 0)
        return len;
      n = b->len[other] - rng_below(b->len[other] + 1);
      n = at + n <= INPUT_CAP ? n : INPUT_CAP - at;
      memcpy(buf + at, b->data[other] + b->len[other] - n, n);
      return at + n;
  }
}

/* Random bytes one time in eight; otherwise a valid input with one to four mutations. */
static size_t make_input(uint8_t *buf, const struct bases *b) {
  size_t len, i, rounds = 1 + rng_below(4);

  if (b->n == 0 || rng() % 8 == 0) {
    len = rng_below(2048);
    for (i = 0; i < len; i++)
      buf[i] = (uint8_t)rng();
    return len;
  }
  i = rng_below(b->n);
  len = b->len[i];
  memcpy(buf, b->data[i], len);
  while (rounds-- > 0)
    len = mutate_once(buf, len, b);
  return len;
}

/* ------------------------------------------------------------------ main */

static int write_seeds(const char *dir, uint8_t *buf) {
  char path[4096];
  size_t len;

  for (unsigned i = 0; (len = sl_fuzz_seed(i, buf, INPUT_CAP)) > 0; i++) {
    snprintf(path, sizeof(path), "%s/seed-%02u", dir, i);
    FILE *f = fopen(path, "wb");
    if (f == NULL || fwrite(buf, 1, len, f) != len) {
      perror(path);
      return 1;
    }
    fclose(f);
  }
  return 0;
}

int main(int argc, char **argv) {
  const char *name = strrchr(argv[0], '/') != NULL ? strrchr(argv[0], '/') + 1 : argv[0];
  uint8_t *buf = malloc(INPUT_CAP);
  struct bases b = {.n = 0};
  struct tally t = {0, 0};
  const char *env = getenv("SUBLET_FUZZ_INPUTS");
  long inputs = env != NULL && atol(env) > 0 ? atol(env) : RANDOM_INPUTS;
  size_t len;

  if (argc == 3 && strcmp(argv[1], "--write-seeds") == 0) {
    int rc = write_seeds(argv[2], buf);
    free(buf);
    return rc;
  }
  if (argc > 1)
    run_corpus(argv[1], buf, &b, &t);
  for (unsigned i = 0; (len = sl_fuzz_seed(i, buf, INPUT_CAP)) > 0; i++)
    bases_add(&b, buf, len);
  for (long i = 0; i < inputs; i++) {
    len = make_input(buf, &b);
    run_one(buf, len, &t);
  }
  bases_free(&b);
  free(buf);
  printf("%s: %d passed, %d failed\n", name, t.passed, t.failed);
  return t.failed == 0 ? 0 : 1;
}
