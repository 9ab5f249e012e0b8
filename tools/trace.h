/* SPDX-License-Identifier: MIT */
/*
 * Traces of attention inputs captured from real models (doc/trace-format.md): a directory holding
 * meta.json and, per layer, the post-RoPE queries, keys and values of the prefill and of the
 * decode steps as .npy arrays. This is the reader and the writer, plus the small JSON parser that
 * reads meta.json; the replay (`kvbench --trace DIR`) is tools/kvbench_trace.c.
 *
 * Every function that can fail returns 0 or a negative errno value (-EINVAL malformed input,
 * -ENOENT or another errno for a file that cannot be read or written, -ENOMEM) and writes into
 * err[errlen] one line that names the file and the field: "layer3.prefill.k.npy: shape (100, 8, 64)
 * but meta.json says n_kv_heads = 4". Nothing here exits, prints or keeps global state.
 */
#ifndef KVBENCH_TRACE_H
#define KVBENCH_TRACE_H

#include <stddef.h>
#include <stdint.h>

#define TRACE_FORMAT "kvtier-trace"
#define TRACE_VERSION 1
/* Limits of the readers: nonsense is rejected before anything is allocated from it. */
#define TRACE_MAX_DIMS 8
#define TRACE_MAX_NPY_HEADER 65536u /* bytes of a .npy header dict */
#define TRACE_MAX_JSON_BYTES (1u << 20)
#define TRACE_MAX_JSON_DEPTH 32
#define TRACE_MAX_JSON_NODES 65536u
#define TRACE_MAX_LAYERS 1024u
#define TRACE_MAX_HEADS 1024u
#define TRACE_MAX_HEAD_DIM 1024u
#define TRACE_MAX_TOKENS (1u << 24)

/* Element types of a trace's arrays. */
typedef enum trace_dtype {
	TRACE_F16 = 1, /* "float16", .npy descr '<f2' */
	TRACE_F32 = 2  /* "float32", .npy descr '<f4' */
} trace_dtype;

/* ---- .npy ----------------------------------------------------------------------------------- */

typedef struct trace_npy {
	trace_dtype dtype;
	uint32_t ndim;
	uint64_t shape[TRACE_MAX_DIMS];
	uint64_t count; /* elements: the product of shape */
	const void
		*data; /* count elements, little-endian, C order; points into the parsed buffer */
	size_t header_len; /* bytes before the data: magic, version, length field and header dict */
} trace_npy;

/*
 * Parse the .npy bytes buf[len] (format 1.0 or 2.0, '<f2' or '<f4', C order). The data must be
 * exactly the shape's size: a truncated array or trailing bytes are errors. `name` is used in the
 * messages. On success out->data points into buf. No allocation.
 */
int trace_npy_parse(const void *buf, size_t len, const char *name, trace_npy *out, char *err,
		    size_t errlen);

/* Write a .npy file (format 1.0, header padded to 64 bytes as numpy does) of `ndim` dims. */
int trace_npy_write(const char *path, trace_dtype dtype, uint32_t ndim, const uint64_t *shape,
		    const void *data, char *err, size_t errlen);

/* ---- JSON ----------------------------------------------------------------------------------- */

typedef enum trace_json_type {
	TJ_NULL,
	TJ_FALSE,
	TJ_TRUE,
	TJ_NUMBER,
	TJ_STRING,
	TJ_ARRAY,
	TJ_OBJECT
} trace_json_type;

/* One value. Children of an array or object are linked through `next`; an object's children are
 * its values, each with its member name in `key`. Indexes refer to trace_json.nodes; 0 ends. */
typedef struct trace_json_node {
	trace_json_type type;
	uint32_t child, next, count; /* first child, next sibling, number of children */
	const char *key;	     /* member name (NUL-terminated) or NULL */
	const char *str; /* TJ_STRING: the decoded text, NUL-terminated (no NUL inside) */
	double num;	 /* TJ_NUMBER */
} trace_json_node;

typedef struct trace_json {
	trace_json_node *nodes; /* nodes[1] is the root; nodes[0] is unused */
	uint32_t n;
	char *pool; /* decoded strings */
} trace_json;

/*
 * Parse text[len] as one JSON value (RFC 8259: objects, arrays, strings with escapes, numbers,
 * true, false, null), strictly: no comments, no trailing commas, no duplicate member names, valid
 * UTF-8 only (RFC 3629: no overlong forms, surrogates or code points above U+10FFFF), at most
 * TRACE_MAX_JSON_BYTES bytes, TRACE_MAX_JSON_DEPTH levels and TRACE_MAX_JSON_NODES values.
 * Messages give name, line and column (and the byte offset of invalid UTF-8). Free with
 * trace_json_free.
 */
int trace_json_parse(const char *text, size_t len, const char *name, trace_json *out, char *err,
		     size_t errlen);
void trace_json_free(trace_json *j);
/*
 * Length (1 to 4) of the valid UTF-8 sequence (RFC 3629) at s[0..n), or 0 when s starts an invalid
 * one; then *why (may be NULL) says what is wrong: a stray continuation byte, an overlong form, a
 * surrogate, a code point above U+10FFFF, or a truncated sequence. n >= 1.
 */
int trace_utf8_len(const unsigned char *s, size_t n, const char **why);
/* The member `key` of object node `obj`, or NULL. */
const trace_json_node *trace_json_get(const trace_json *j, const trace_json_node *obj,
				      const char *key);

/* ---- the trace ------------------------------------------------------------------------------ */

typedef struct trace_meta {
	char model[256]; /* free text */
	char rope[512];	 /* free text: RoPE type, theta, scaling */
	uint32_t n_layers, n_q_heads, n_kv_heads, head_dim;
	trace_dtype dtype;
	uint32_t prefill_tokens; /* T >= 1 */
	uint32_t decode_steps;	 /* S >= 1 */
	double scale;		 /* attention scale; 0: 1/sqrt(head_dim) */
} trace_meta;

/* Arrays of one layer, as floats (exact for float16 and float32 traces), row-major. */
typedef struct trace_layer {
	float *prefill_q; /* [T, n_q_heads, head_dim] */
	float *prefill_k; /* [T, n_kv_heads, head_dim] */
	float *prefill_v; /* [T, n_kv_heads, head_dim] */
	float *decode_q;  /* [S, n_q_heads, head_dim] */
	float *decode_k;  /* [S, n_kv_heads, head_dim] */
	float *decode_v;  /* [S, n_kv_heads, head_dim] */
} trace_layer;

enum { TRACE_ARRAYS = 6 }; /* arrays per layer, in trace_layer's order */

/* "layer{L}.{prefill,decode}.{q,k,v}.npy" for array a (0..5, trace_layer's order), into out. */
void trace_file_name(uint32_t layer, unsigned a, char *out, size_t n);

/*
 * Check and read meta.json text (name for the messages): format, version, shape (each count within
 * the TRACE_MAX_ limits, n_q_heads a multiple of n_kv_heads), dtype, token counts, scale, and a
 * `files` list that is exactly the 6 x n_layers array names. Members it does not know are ignored.
 */
int trace_meta_parse(const char *text, size_t len, const char *name, trace_meta *m, char *err,
		     size_t errlen);

/*
 * Open the trace directory `dir`: parse meta.json, then check the header of every array file
 * (present, readable, dtype and shape matching meta.json, size exact) without reading the data.
 */
int trace_open(const char *dir, trace_meta *m, char *err, size_t errlen);

/*
 * Read the six arrays of `layer` into *out (allocated here; free with trace_layer_free), checking
 * them again and rejecting any element that is NaN or infinite (the message gives its token, head
 * and dim).
 */
int trace_load_layer(const char *dir, const trace_meta *m, uint32_t layer, trace_layer *out,
		     char *err, size_t errlen);
void trace_layer_free(trace_layer *l);

/* Write meta.json for *m (the `files` list included) into the existing directory dir. */
int trace_write_meta(const char *dir, const trace_meta *m, char *err, size_t errlen);
/* Write the six arrays of one layer in m->dtype (float16: rounded to nearest even). */
int trace_write_layer(const char *dir, const trace_meta *m, uint32_t layer, const trace_layer *l,
		      char *err, size_t errlen);

/* IEEE binary16 and bfloat16 conversions (round to nearest even), used by the reader, the writer
 * and the replay. */
float trace_f16_to_f32(uint16_t h);
uint16_t trace_f32_to_f16(float f);
float trace_bf16_to_f32(uint16_t h);
uint16_t trace_f32_to_bf16(float f);

/* Internal to tools/trace*.c: the Python text of a shape tuple ("(3,)", "(3, 4)") into out, and
 * dir/file into out. */
void trace_shape_text(const uint64_t *shape, uint32_t ndim, char *out, size_t n);
void trace_join(const char *dir, const char *file, char *out, size_t n);

/* Write the printf-style text to err (n bytes, may be NULL) and return `code`: the error form of
 * every function above, shared by tools/trace.c and tools/trace_json.c. */
#if defined(__GNUC__)
__attribute__((format(printf, 4, 5)))
#endif
int trace_errf(char *err, size_t n, int code, const char *fmt, ...);

#endif /* KVBENCH_TRACE_H */
