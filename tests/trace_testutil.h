/* SPDX-License-Identifier: MIT */
/*
 * What the trace tests share (test_trace.c, which holds main and the format tests, and
 * test_trace_replay.c; test_kvbench_opts.c runs kvbench through it too): a trace directory
 * written from random data, files read and poked, kvbench run in a child, the tests' own UTF-8
 * check.
 */
#ifndef KVT_TESTS_TRACE_TESTUTIL_H
#define KVT_TESTS_TRACE_TESTUTIL_H

#include "kvbench.h" /* before common.h, whose fail() macro it would clash with */
#include "kvbench_trace.h" /* kb_lru, the replay's simulated hot cache */
#include "common.h"
#include "trace.h"

#define ERRLEN 1024

typedef struct tdir {
	char path[64];
	trace_meta m;
} tdir;

void path_of(const tdir *t, const char *file, char *out, size_t n);

/* A trace of random post-RoPE-like vectors: keys with a shared offset, queries that prefer a few
 * tokens, so that attention is neither uniform nor one-hot. */
void fill_layer(t_rng *r, const trace_meta *m, trace_layer *l);

void make_trace(tdir *t, trace_dtype dtype, uint32_t layers, uint32_t T, uint32_t S,
		uint64_t seed);

void remove_trace(tdir *t);

void write_bytes(const char *path, const void *b, size_t n);

unsigned char *read_bytes(const char *path, size_t *n);

/* A .npy image from a header dict (padded by the caller or not) and `data` bytes. */
size_t npy_image(unsigned char *out, int major, const char *dict, size_t data);

/* The whole trace must be rejected (by trace_open or by loading a layer) with a message that
 * contains every one of the words. */
void expect_reject(const tdir *t, const char *what, const char *w1, const char *w2);

/* Rewrite byte `at` of a file (negative: from the end). */
void poke(const tdir *t, const char *file, long at, unsigned char v);

void truncate_file(const tdir *t, const char *file, size_t cut);

void write_meta_text(const tdir *t, const char *text);

/* meta.json as trace_write_meta writes it, with one substring replaced. */
void edit_meta(const tdir *t, const char *from, const char *to);

/* Run kvbench's entry point (kvbench_main, as the executable does) in a child process, since
 * kvbench exits on errors, in directory `dir` (NULL: this one), with stdout and stderr captured
 * into *out and *errs (NUL-terminated; the caller frees them). Returns the exit status. */
int t_kvbench(char **argv, const char *dir, char **out, char **errs);

/* kvbench's --json stdout `out` parsed into *j (trace_json_free it), or the test fails naming
 * `what`, the parser's error and the output. */
void t_json_stdout(const char *what, const char *out, trace_json *j);

/* The tests' own RFC 3629 check, by code point: the length of the valid sequence at s, or 0. */
size_t t_utf8_ok(const unsigned char *s, size_t n);

/* Offset of the first invalid UTF-8 sequence of s[0..n), or n when all of it is valid. */
size_t t_utf8_bad_at(const char *s, size_t n);

/* test_trace_replay.c */
void test_replay(void **state);
void test_replay_overflow(void **state);
void test_replay_sweep(void **state);
void test_replay_utf8(void **state);

#endif
