/* SPDX-License-Identifier: MIT */
/*
 * The JSON parser of trace metadata (tools/trace.h): strict recursive descent over objects, arrays,
 * strings with escapes, numbers, true, false and null, into a flat node array, with depth and size
 * limits. The input is untrusted; every error names the file and where.
 */
#include "trace.h"

#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct jp {
	const char *s;
	size_t n, i;
	trace_json *j;
	uint32_t cap;
	size_t pool_used;
	const char *name;
	char *err;
	size_t en;
} jp;

static int j_fail(jp *p, const char *what)
{
	uint32_t line = 1, col = 1;
	for (size_t k = 0; k < p->i && k < p->n; k++) {
		col = p->s[k] == '\n' ? 1 : col + 1;
		line += p->s[k] == '\n';
	}
	return trace_errf(p->err, p->en, -EINVAL, "%s: line %u, column %u: %s", p->name, line, col, what);
}

static uint32_t j_err(jp *p, const char *what)
{
	j_fail(p, what);
	return 0;
}

static void j_ws(jp *p)
{
	while (p->i < p->n && (p->s[p->i] == ' ' || p->s[p->i] == '\t' || p->s[p->i] == '\n' ||
			       p->s[p->i] == '\r'))
		p->i++;
}

static uint32_t j_node(jp *p, trace_json_type t)
{
	if (p->j->n == p->cap) {
		if (p->cap >= TRACE_MAX_JSON_NODES)
			return 0;
		uint32_t cap = p->cap ? p->cap * 2 : 64;
		trace_json_node *nn = realloc(p->j->nodes, cap * sizeof(*nn));
		if (!nn)
			return 0;
		p->j->nodes = nn;
		p->cap = cap;
	}
	uint32_t k = p->j->n++;
	p->j->nodes[k] = (trace_json_node){.type = t};
	return k;
}

static int hexval(char c)
{
	return c >= '0' && c <= '9'   ? c - '0'
	       : c >= 'a' && c <= 'f' ? c - 'a' + 10
	       : c >= 'A' && c <= 'F' ? c - 'A' + 10
				      : -1;
}

static int j_hex4(jp *p, uint32_t *u)
{
	if (p->n - p->i < 4)
		return -1;
	*u = 0;
	for (int k = 0; k < 4; k++) {
		int h = hexval(p->s[p->i + (size_t)k]);
		if (h < 0)
			return -1;
		*u = *u << 4 | (uint32_t)h;
	}
	p->i += 4;
	return 0;
}

int trace_utf8_len(const unsigned char *s, size_t n, const char **why)
{
	const char *w = NULL;
	int len = 0;
	unsigned char c = s[0], lo = 0x80, hi = 0xbf; /* the range of the second byte */
	if (c < 0x80)
		return 1;
	if (c < 0xc0)
		w = "a continuation byte where a character starts";
	else if (c < 0xc2)
		w = "an overlong two-byte form";
	else if (c < 0xe0)
		len = 2;
	else if (c < 0xf0) {
		len = 3;
		lo = c == 0xe0 ? 0xa0 : 0x80; /* below: overlong */
		hi = c == 0xed ? 0x9f : 0xbf; /* above: a surrogate, U+D800..U+DFFF */
	} else if (c < 0xf5) {
		len = 4;
		lo = c == 0xf0 ? 0x90 : 0x80; /* below: overlong */
		hi = c == 0xf4 ? 0x8f : 0xbf; /* above: beyond U+10FFFF */
	} else {
		w = "a lead byte of a code point above U+10FFFF";
	}
	if (len && (n < 2 || s[1] < lo || s[1] > hi)) {
		w = n < 2 || s[1] < 0x80 || s[1] > 0xbf ? "a truncated sequence"
		    : c == 0xed				 ? "a surrogate (U+D800..U+DFFF)"
		    : c == 0xf4 && s[1] > 0x8f		 ? "a code point above U+10FFFF"
							 : "an overlong form";
		len = 0;
	}
	for (int k = 2; k < len; k++)
		if ((size_t)k >= n || s[k] < 0x80 || s[k] > 0xbf) {
			w = "a truncated sequence";
			len = 0;
		}
	if (why)
		*why = w;
	return len;
}

/* A string at p->i (on its '"') decoded into the pool; returns it or NULL (error set). */
static char *j_string(jp *p)
{
	char *out = p->j->pool + p->pool_used;
	size_t k = 0;
	p->i++;
	for (;;) {
		if (p->i >= p->n)
			return j_fail(p, "unterminated string"), NULL;
		unsigned char c = (unsigned char)p->s[p->i];
		if (c == '"')
			break;
		if (c < 0x20)
			return j_fail(p, "control character in a string"), NULL;
		if (c >= 0x80) {
			const char *why;
			int len = trace_utf8_len((const unsigned char *)p->s + p->i, p->n - p->i, &why);
			if (!len) {
				char what[160];
				snprintf(what, sizeof what, "invalid UTF-8 at byte offset %zu (0x%02x): %s",
					 p->i, c, why);
				return j_fail(p, what), NULL;
			}
			memcpy(out + k, p->s + p->i, (size_t)len);
			k += (size_t)len;
			p->i += (size_t)len;
			continue;
		}
		if (c != '\\') {
			out[k++] = (char)c;
			p->i++;
			continue;
		}
		if (++p->i >= p->n)
			return j_fail(p, "unterminated escape"), NULL;
		char e = p->s[p->i++];
		const char *from = "\"\\/bfnrt", *to = "\"\\/\b\f\n\r\t", *at = strchr(from, e);
		if (e && at) {
			out[k++] = to[at - from];
			continue;
		}
		uint32_t u, lo;
		if (e != 'u' || j_hex4(p, &u) < 0)
			return j_fail(p, "bad escape in a string"), NULL;
		if (u >= 0xdc00 && u < 0xe000)
			return j_fail(p, "unpaired low surrogate in a string"), NULL;
		if (u >= 0xd800 && u < 0xdc00) {
			if (p->n - p->i < 2 || p->s[p->i] != '\\' || p->s[p->i + 1] != 'u')
				return j_fail(p, "unpaired high surrogate in a string"), NULL;
			p->i += 2;
			if (j_hex4(p, &lo) < 0 || lo < 0xdc00 || lo >= 0xe000)
				return j_fail(p, "bad low surrogate in a string"), NULL;
			u = 0x10000 + ((u - 0xd800) << 10) + (lo - 0xdc00);
		}
		if (!u)
			return j_fail(p, "\\u0000 in a string"), NULL;
		if (u < 0x80) {
			out[k++] = (char)u;
		} else if (u < 0x800) {
			out[k++] = (char)(0xc0 | u >> 6);
			out[k++] = (char)(0x80 | (u & 0x3f));
		} else if (u < 0x10000) {
			out[k++] = (char)(0xe0 | u >> 12);
			out[k++] = (char)(0x80 | ((u >> 6) & 0x3f));
			out[k++] = (char)(0x80 | (u & 0x3f));
		} else {
			out[k++] = (char)(0xf0 | u >> 18);
			out[k++] = (char)(0x80 | ((u >> 12) & 0x3f));
			out[k++] = (char)(0x80 | ((u >> 6) & 0x3f));
			out[k++] = (char)(0x80 | (u & 0x3f));
		}
	}
	p->i++;
	out[k++] = 0;
	p->pool_used += k;
	return out;
}

static uint32_t j_value(jp *p, int depth);

static bool j_digits(jp *p)
{
	size_t i0 = p->i;
	while (p->i < p->n && p->s[p->i] >= '0' && p->s[p->i] <= '9')
		p->i++;
	return p->i > i0;
}

static uint32_t j_number(jp *p)
{
	size_t i0 = p->i;
	char buf[64];
	if (p->s[p->i] == '-')
		p->i++;
	if (p->i < p->n && p->s[p->i] == '0')
		p->i++;
	else if (!j_digits(p))
		return j_err(p, "bad number");
	if (p->i < p->n && p->s[p->i] == '.' && (p->i++, !j_digits(p)))
		return j_err(p, "bad number: no digit after '.'");
	if (p->i < p->n && (p->s[p->i] == 'e' || p->s[p->i] == 'E')) {
		p->i++;
		if (p->i < p->n && (p->s[p->i] == '+' || p->s[p->i] == '-'))
			p->i++;
		if (!j_digits(p))
			return j_err(p, "bad number: no digit in the exponent");
	}
	if (p->i - i0 >= sizeof(buf))
		return j_err(p, "number longer than 63 characters");
	memcpy(buf, p->s + i0, p->i - i0);
	buf[p->i - i0] = 0;
	uint32_t k = j_node(p, TJ_NUMBER);
	if (!k)
		return j_err(p, "too many values");
	p->j->nodes[k].num = strtod(buf, NULL);
	if (!isfinite(p->j->nodes[k].num))
		return j_err(p, "number out of range");
	return k;
}

/* The elements of an array or members of an object, after its opening bracket. */
static uint32_t j_container(jp *p, int depth, bool obj)
{
	uint32_t k = j_node(p, obj ? TJ_OBJECT : TJ_ARRAY), last = 0;
	if (!k)
		return j_err(p, "too many values");
	char close = obj ? '}' : ']';
	j_ws(p);
	if (p->i < p->n && p->s[p->i] == close) {
		p->i++;
		return k;
	}
	for (;;) {
		const char *key = NULL;
		j_ws(p);
		if (obj) {
			if (p->i >= p->n || p->s[p->i] != '"')
				return j_err(p, "expected a member name");
			if (!(key = j_string(p)))
				return 0;
			if (p->j->nodes[k].count >= 4096)
				return j_err(p, "more than 4096 members in an object");
			for (uint32_t c = p->j->nodes[k].child; c; c = p->j->nodes[c].next)
				if (!strcmp(p->j->nodes[c].key, key))
					return j_err(p, "member name given twice");
			j_ws(p);
			if (p->i >= p->n || p->s[p->i] != ':')
				return j_err(p, "expected ':'");
			p->i++;
		}
		uint32_t v = j_value(p, depth + 1);
		if (!v)
			return 0;
		p->j->nodes[v].key = key;
		if (last)
			p->j->nodes[last].next = v;
		else
			p->j->nodes[k].child = v;
		last = v;
		p->j->nodes[k].count++;
		j_ws(p);
		if (p->i < p->n && p->s[p->i] == ',') {
			p->i++;
			continue;
		}
		if (p->i < p->n && p->s[p->i] == close) {
			p->i++;
			return k;
		}
		return j_err(p, obj ? "expected ',' or '}'" : "expected ',' or ']'");
	}
}

static uint32_t j_value(jp *p, int depth)
{
	static const struct {
		const char *w;
		trace_json_type t;
	} words[] = {{"null", TJ_NULL}, {"true", TJ_TRUE}, {"false", TJ_FALSE}};
	if (depth > TRACE_MAX_JSON_DEPTH)
		return j_err(p, "nested too deep");
	j_ws(p);
	if (p->i >= p->n)
		return j_err(p, "expected a value, found the end");
	char c = p->s[p->i];
	if (c == '{' || c == '[') {
		p->i++;
		return j_container(p, depth, c == '{');
	}
	if (c == '"') {
		uint32_t k = j_node(p, TJ_STRING);
		if (!k)
			return j_err(p, "too many values");
		const char *s = j_string(p);
		p->j->nodes[k].str = s;
		return s ? k : 0;
	}
	if (c == '-' || (c >= '0' && c <= '9'))
		return j_number(p);
	for (size_t w = 0; w < 3; w++) {
		size_t n = strlen(words[w].w);
		if (p->n - p->i >= n && !memcmp(p->s + p->i, words[w].w, n)) {
			uint32_t k = j_node(p, words[w].t);
			p->i += n;
			if (!k)
				return j_err(p, "too many values");
			return k;
		}
	}
	return j_err(p, "expected a value");
}

int trace_json_parse(const char *text, size_t len, const char *name, trace_json *out, char *err,
		     size_t errlen)
{
	memset(out, 0, sizeof(*out));
	if (len > TRACE_MAX_JSON_BYTES)
		return trace_errf(err, errlen, -EINVAL, "%s: %zu bytes, more than the limit %u", name,
			    len, TRACE_MAX_JSON_BYTES);
	jp p = {.s = text, .n = len, .j = out, .name = name, .err = err, .en = errlen};
	/* decoded strings are never longer than their text, plus one NUL each */
	out->pool = malloc(2 * len + 1);
	if (out->pool)
		j_node(&p, TJ_NULL); /* node 0, unused: index 0 ends lists */
	if (!out->pool || out->n != 1) {
		trace_json_free(out);
		return trace_errf(err, errlen, -ENOMEM, "%s: out of memory", name);
	}
	uint32_t root = j_value(&p, 1);
	if (root) {
		j_ws(&p);
		if (p.i != p.n) {
			j_fail(&p, "text after the value");
			root = 0;
		}
	}
	if (!root) {
		trace_json_free(out);
		return -EINVAL;
	}
	return 0;
}

void trace_json_free(trace_json *j)
{
	free(j->nodes);
	free(j->pool);
	memset(j, 0, sizeof(*j));
}

const trace_json_node *trace_json_get(const trace_json *j, const trace_json_node *obj,
				      const char *key)
{
	if (!obj || obj->type != TJ_OBJECT)
		return NULL;
	for (uint32_t c = obj->child; c; c = j->nodes[c].next)
		if (!strcmp(j->nodes[c].key, key))
			return &j->nodes[c];
	return NULL;
}
