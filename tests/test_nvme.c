/* SPDX-License-Identifier: MIT */
/*
 * The NVMe block store (host/nvme_*.c, crc32c.c):
 * CRC-32C against the standard check value in both implementations, the block format's checks,
 * byte-identical round trips of many random blocks across several files (whole blocks and row
 * ranges, blocks spanning several bounce slots), all-or-nothing -ENOSPC, free and reuse, refusal
 * of a block under the wrong identity, the header cache (hits, corrupt or stale chunks under a
 * cached header, invalidation on free and rewrite), and the page-cache (buffered) path.
 * Scratch files go to $KVT_TEST_DIR or the current directory; exits 77 without io_uring.
 */
#include <sys/vfs.h>

#include "host/crc32c.h"
#include "nvme_util.h"

#define TMPFS_MAGIC_ 0x01021994

static void test_crc32c(void **state)
{
	(void)state;
	const char *v = "123456789";
	uint32_t hw = 0;
	T_CHECK(kvt_crc32c(0, v, 9) == 0xE3069283u,
		"crc32c(\"123456789\") got 0x%08x, wanted 0xE3069283", kvt_crc32c(0, v, 9));
	T_CHECK(kvt_crc32c_sw(0, v, 9) == 0xE3069283u,
		"software crc32c got 0x%08x, wanted 0xE3069283", kvt_crc32c_sw(0, v, 9));
	int have_hw = kvt_crc32c_hw(0, v, 9, &hw) == 0;
	printf("crc32c implementation: %s\n", kvt_crc32c_impl());
	if (have_hw)
		T_CHECK(hw == 0xE3069283u, "sse4.2 crc32c got 0x%08x, wanted 0xE3069283", hw);
	/* Other published values: 32 zero bytes and 32 0xff bytes (RFC 3720 B.4). */
	unsigned char z[32], o[32];
	memset(z, 0, sizeof z);
	memset(o, 0xff, sizeof o);
	T_CHECK(kvt_crc32c(0, z, 32) == 0x8A9136AAu,
		"crc32c(32 x 00) got 0x%08x, wanted 0x8A9136AA", kvt_crc32c(0, z, 32));
	T_CHECK(kvt_crc32c(0, o, 32) == 0x62A8AB43u,
		"crc32c(32 x ff) got 0x%08x, wanted 0x62A8AB43", kvt_crc32c(0, o, 32));
	/* Random lengths and offsets: both implementations agree; chaining splits anywhere. */
	t_rng r;
	t_rng_seed(&r, 42);
	unsigned char *buf = nv_random_payload(&r, 70000);
	for (int t = 0; t < 300; t++) {
		size_t off = t_below(&r, 64), n = t_below(&r, 65000),
		       cut = n ? t_below(&r, (uint32_t)n) : 0;
		uint32_t sw = kvt_crc32c_sw(0, buf + off, n), all = kvt_crc32c(0, buf + off, n);
		uint32_t two = kvt_crc32c(kvt_crc32c(0, buf + off, cut), buf + off + cut, n - cut);
		T_CHECK(sw == all && two == all,
			"len %zu at +%zu cut %zu: sw 0x%08x, dispatch 0x%08x, "
			"chained 0x%08x",
			n, off, cut, sw, all, two);
		if (have_hw) {
			kvt_crc32c_hw(0, buf + off, n, &hw);
			T_CHECK(hw == sw, "len %zu at +%zu: sse4.2 0x%08x, software 0x%08x", n, off,
				hw, sw);
		}
	}
	/* Chunked CRCs (four streams side by side) equal one CRC per chunk. */
	for (size_t n = 0; n <= 9; n++) {
		uint32_t got[9];
		kvt_crc32c_chunks(buf + 3, 4096, n, got);
		for (size_t i = 0; i < n; i++) {
			uint32_t want = kvt_crc32c_sw(0, buf + 3 + i * 4096, 4096);
			T_CHECK(got[i] == want, "chunk %zu of %zu: 0x%08x, wanted 0x%08x", i, n,
				got[i], want);
		}
	}
	free(buf);
}

/* The format alone: a block verifies under its own identity and fails, by name, under any other. */
static void test_format(void **state)
{
	(void)state;
	t_rng r;
	t_rng_seed(&r, 7);
	struct kvt_nvme_block_id id = nv_id(&r, 37, 64);
	uint32_t p = kvt_nvme_payload_bytes(&id), hb = kvt_nvme_header_bytes(p);
	uint32_t d = kvt_nvme_data_offset(p, 4096);
	uint64_t disk = kvt_nvme_disk_bytes(&id, 4096);
	T_CHECK(p == 37 * 64 * 4 && hb == 72 + 4 * 3 && d == 4096 && disk == 16384,
		"sizes: payload %u header %u data at %u disk %llu, wanted 9472 84 4096 16384", p,
		hb, d, (unsigned long long)disk);
	unsigned char *src = nv_random_payload(&r, p), *img = t_alloc(disk);
	const uint64_t store = 0x5eed5707e1d0001ull;
	kvt_nvme_encode(&id, store, src, img, disk, 4096);
	T_CHECK(memcmp(img, "KVTB", 4) == 0 && memcmp(img + d, src, p) == 0,
		"the image starts with KVTB and holds the payload at the aligned data offset");
	struct kvt_nvme_view v = {img,	      img + d, 0, 3, img + d + p, (uint32_t)(disk - d - p),
				  img + hb, d - hb};
	struct kvt_err why;
	int rc = kvt_nvme_verify(&v, &id, store, &why);
	T_CHECK(rc == 0, "verify of a fresh image: got %d (%s), wanted 0", rc, why.msg);
	/* another store's block, identity and checksums right: refused by the store id */
	rc = kvt_nvme_verify(&v, &id, store + 1, &why);
	T_CHECK(rc == -EBADMSG && strstr(why.msg, "store id"),
		"verify under another store id: got %d (%s), wanted -EBADMSG naming the store id", rc,
		why.msg);
	const char *names[] = {"seq",   "generation", "first_token", "n_tokens",
			       "layer", "kv_head",    "flags"};
	for (int k = 0; k < 7; k++) {
		struct kvt_nvme_block_id e = id;
		switch (k) {
		case 0: e.seq++; break;
		case 1: e.generation++; break;
		case 2: e.first_token++; break;
		case 3: break; /* n_tokens changes the sizes: checked below */
		case 4: e.layer++; break;
		case 5: e.kv_head++; break;
		default: e.flags ^= 1; break;
		}
		if (k == 3)
			continue;
		rc = kvt_nvme_verify(&v, &e, store, &why);
		T_CHECK(rc == -EBADMSG && strstr(why.msg, names[k]),
			"expect with another %s: got %d (%s), "
			"wanted -EBADMSG naming it",
			names[k], rc, why.msg);
	}
	struct kvt_nvme_block_id e = id;
	e.n_tokens = 36;
	rc = kvt_nvme_verify(&v, &e, store, &why);
	T_CHECK(rc == -EBADMSG && strstr(why.msg, "sizes"), "36 rows expected: got %d (%s)", rc, why.msg);
	img[disk - 1] = 1;
	rc = kvt_nvme_verify(&v, &id, store, &why);
	T_CHECK(rc == -EBADMSG && strstr(why.msg, "padding"), "nonzero padding: got %d (%s)", rc, why.msg);
	img[disk - 1] = 0;
	img[d - 1] = 0x10; /* header padding: not under the header CRC, refused all the same */
	rc = kvt_nvme_verify(&v, &id, store, &why);
	T_CHECK(rc == -EBADMSG && strstr(why.msg, "after the header"),
		"nonzero header padding: got %d (%s)", rc, why.msg);
	free(src);
	free(img);
}

struct nv_written {
	struct kvt_nvme_block_id id;
	struct kvt_nvme_loc loc;
	unsigned char *payload;
	uint32_t bytes;
};

/* Write `n` random blocks in batches of 1..max_batch; rows per block in [1, max_tokens]. */
static void write_random(struct kvt_nvme *st, t_rng *r, struct nv_written *w, uint32_t n,
			 uint32_t max_tokens, uint32_t max_batch)
{
	for (uint32_t i = 0; i < n;) {
		uint32_t b = 1 + t_below(r, max_batch);
		b = b > n - i ? n - i : b;
		struct kvt_nvme_block blk[64];
		struct kvt_nvme_loc locs[64];
		for (uint32_t j = 0; j < b; j++) {
			w[i + j].id =
				nv_id(r, 1 + t_below(r, max_tokens), t_below(r, 2) ? 128 : 64);
			w[i + j].id.seq =
				i + j; /* distinct, so a block read at another's loc fails */
			w[i + j].bytes = kvt_nvme_payload_bytes(&w[i + j].id);
			w[i + j].payload = nv_random_payload(r, w[i + j].bytes);
			blk[j].id = w[i + j].id;
			blk[j].payload = w[i + j].payload;
		}
		int rc = kvt_nvme_write_blocks(st, b, blk, locs, &nv_err);
		T_CHECK(rc == 0, "write of blocks %u..%u: got %d (%s), wanted 0", i, i + b, rc,
			nv_err.msg);
		for (uint32_t j = 0; j < b; j++)
			w[i + j].loc = locs[j];
		i += b;
	}
}

/* Read back every block in a random order and batches, whole, then random row ranges. */
static void read_check(struct kvt_nvme *st, t_rng *r, struct nv_written *w, uint32_t n)
{
	uint32_t *order = t_alloc(n * sizeof *order);
	for (uint32_t i = 0; i < n; i++)
		order[i] = i;
	for (uint32_t i = n; i > 1; i--) {
		uint32_t j = t_below(r, i), t = order[i - 1];
		order[i - 1] = order[j];
		order[j] = t;
	}
	for (uint32_t i = 0; i < n;) {
		uint32_t b = 1 + t_below(r, 24);
		b = b > n - i ? n - i : b;
		struct kvt_nvme_loc locs[24];
		struct kvt_nvme_block_id ids[24];
		void *outs[24];
		for (uint32_t j = 0; j < b; j++) {
			struct nv_written *x = &w[order[i + j]];
			locs[j] = x->loc;
			ids[j] = x->id;
			outs[j] = t_alloc(x->bytes);
			memset(outs[j], 0xa5, x->bytes);
		}
		int rc = kvt_nvme_read_blocks(st, b, locs, ids, outs, &nv_err);
		T_CHECK(rc == 0, "read of %u blocks: got %d (%s), wanted 0", b, rc,
			nv_err.msg);
		for (uint32_t j = 0; j < b; j++) {
			struct nv_written *x = &w[order[i + j]];
			T_CHECK(memcmp(outs[j], x->payload, x->bytes) == 0,
				"block seq %llu (%u bytes at file %u offset %llu) differs after "
				"the round trip",
				(unsigned long long)x->id.seq, x->bytes, x->loc.file,
				(unsigned long long)x->loc.offset);
			free(outs[j]);
		}
		i += b;
	}
	for (uint32_t t = 0; t < 2 * n; t++) {
		struct nv_written *x = &w[t_below(r, n)];
		uint32_t a = t_below(r, x->id.n_tokens), e = a + 1 + t_below(r, x->id.n_tokens - a);
		size_t row = (size_t)x->id.head_dim * 4, bytes = (e - a) * row;
		struct kvt_nvme_rows q = {x->loc, x->id, a, e, t_alloc(bytes)};
		int rc = kvt_nvme_read_rows(st, 1, &q, &nv_err);
		T_CHECK(rc == 0 && memcmp(q.out, x->payload + a * row, bytes) == 0,
			"rows [%u, %u) of block seq %llu (%u rows): got %d (%s), wanted 0 and "
			"equal bytes",
			a, e, (unsigned long long)x->id.seq, x->id.n_tokens, rc,
			nv_err.msg);
		free(q.out);
	}
	free(order);
}

static void free_written(struct nv_written *w, uint32_t n)
{
	for (uint32_t i = 0; i < n; i++)
		free(w[i].payload);
}

static void test_round_trip(void **state)
{
	(void)state;
	nv_files f;
	int64_t live0 = kvt_mem_live();
	int fds0 = t_fd_count();
	/* Three files; 64 KiB bounce slots, so blocks of up to 300 rows x 512 B span several. */
	struct kvt_nvme *st = nv_open(&f, nv_dir(), 3, (uint64_t)64 << 20, 16, 64 << 10);
	printf("store: %s\n", kvt_nvme_status(st));
	printf("I/O alignment: %u bytes\n", kvt_nvme_alignment(st));
	t_rng r;
	t_rng_seed(&r, 1234);
	enum { N = 300 };
	struct nv_written *w = t_alloc(N * sizeof *w);
	write_random(st, &r, w, N, 300, 40);
	uint32_t per_file[3] = {0};
	for (uint32_t i = 0; i < N; i++) {
		per_file[w[i].loc.file]++;
		T_CHECK(w[i].loc.offset % kvt_nvme_alignment(st) == 0 &&
				w[i].loc.bytes == kvt_nvme_block_bytes(st, &w[i].id),
			"block %u: loc offset %llu bytes %u, alignment %u, block bytes %llu", i,
			(unsigned long long)w[i].loc.offset, w[i].loc.bytes, kvt_nvme_alignment(st),
			(unsigned long long)kvt_nvme_block_bytes(st, &w[i].id));
	}
	T_CHECK(per_file[0] && per_file[1] && per_file[2],
		"blocks per file %u %u %u: all files used", per_file[0], per_file[1], per_file[2]);
	read_check(st, &r, w, N);
	struct kvt_nvme_stats s;
	kvt_nvme_get_stats(st, &s);
	printf("written %llu blocks in %llu I/Os, read %llu in %llu I/Os, %llu submits, mean "
	       "latency "
	       "%.1f us, max %.1f us, %llu completions out of order\n",
	       (unsigned long long)s.blocks_written, (unsigned long long)s.write_ios,
	       (unsigned long long)s.blocks_read, (unsigned long long)s.read_ios,
	       (unsigned long long)s.submits,
	       s.lat_sum_ns / 1e3 / (double)(s.read_ios + s.write_ios), s.lat_max_ns / 1e3,
	       (unsigned long long)s.reordered);
	T_CHECK(s.blocks_written == N && s.checksum_failures == 0 && s.io_errors == 0,
		"stats: %llu written, %llu checksum failures, %llu I/O errors",
		(unsigned long long)s.blocks_written, (unsigned long long)s.checksum_failures,
		(unsigned long long)s.io_errors);
	for (uint32_t i = 0; i < N; i++)
		kvt_nvme_free(st, 1, &w[i].loc);
	kvt_nvme_get_stats(st, &s);
	T_CHECK(s.bytes_used == 0 && s.bad_frees == 0,
		"after freeing all: %llu bytes used, %llu "
		"bad frees",
		(unsigned long long)s.bytes_used, (unsigned long long)s.bad_frees);
	kvt_nvme_close(st);
	free_written(w, N);
	free(w);
	T_CHECK(kvt_mem_live() == live0 && t_fd_count() == fds0,
		"leak: live %lld (was %lld), fds %d "
		"(were %d)",
		(long long)kvt_mem_live(), (long long)live0, t_fd_count(), fds0);
}

/* Fill two small files to -ENOSPC: the failing call changes nothing; freed space is reused. */
static void test_enospc_free_reuse(void **state)
{
	(void)state;
	nv_files f;
	struct kvt_nvme *st = nv_open(&f, nv_dir(), 2, 256 << 10, 4, 32 << 10);
	t_rng r;
	t_rng_seed(&r, 99);
	enum { MAXB = 128 };
	struct nv_written w[MAXB];
	uint32_t n = 0;
	int rc = 0;
	for (; n < MAXB; n++) {
		w[n].id =
			nv_id(&r, 16, 64); /* 4 KiB payload: 8 KiB on disk with a 4 KiB alignment */
		w[n].id.seq = n;
		w[n].bytes = kvt_nvme_payload_bytes(&w[n].id);
		w[n].payload = nv_random_payload(&r, w[n].bytes);
		struct kvt_nvme_block b = {w[n].id, w[n].payload};
		rc = kvt_nvme_write_blocks(st, 1, &b, &w[n].loc, &nv_err);
		if (rc)
			break;
	}
	T_CHECK(rc == -ENOSPC && n > 0, "filling: got %d after %u blocks (%s), wanted -ENOSPC", rc,
		n, nv_err.msg);
	printf("full after %u blocks: %s\n", n, nv_err.msg);
	free(w[n].payload);
	struct kvt_nvme_stats s0, s1;
	kvt_nvme_get_stats(st, &s0);
	/* Free two blocks, ask for three: still -ENOSPC, and the two freed ranges stay free. */
	kvt_nvme_free(st, 1, &w[1].loc);
	kvt_nvme_free(st, 1, &w[2].loc);
	kvt_nvme_get_stats(st, &s0);
	struct kvt_nvme_block b3[3];
	struct kvt_nvme_loc l3[3];
	for (int i = 0; i < 3; i++)
		b3[i] = (struct kvt_nvme_block){w[0].id, w[0].payload};
	rc = kvt_nvme_write_blocks(st, 3, b3, l3, &nv_err);
	kvt_nvme_get_stats(st, &s1);
	T_CHECK(rc == -ENOSPC && s1.bytes_used == s0.bytes_used && l3[0].bytes == 0 &&
			l3[1].bytes == 0,
		"3 blocks into room for 2: got %d (%s), used %llu -> %llu, locs %u %u", rc,
		nv_err.msg, (unsigned long long)s0.bytes_used,
		(unsigned long long)s1.bytes_used, l3[0].bytes, l3[1].bytes);
	T_CHECK(strstr(nv_err.msg, "need") && strstr(nv_err.msg, "free"),
		"the -ENOSPC message names the bytes needed and free: %s", nv_err.msg);
	/* Two fit: they reuse the freed ranges. */
	for (int i = 1; i <= 2; i++) {
		w[i].id.generation++;
		memset(w[i].payload, 0x10 + i, w[i].bytes);
		struct kvt_nvme_block b = {w[i].id, w[i].payload};
		rc = kvt_nvme_write_blocks(st, 1, &b, &w[i].loc, &nv_err);
		T_CHECK(rc == 0, "rewrite of block %d into freed space: got %d (%s)", i, rc,
			nv_err.msg);
	}
	read_check(st, &r, w, n);
	/* A double free is refused and counted; the space stays consistent. */
	kvt_nvme_free(st, 1, &w[0].loc);
	kvt_nvme_free(st, 1, &w[0].loc);
	kvt_nvme_get_stats(st, &s1);
	T_CHECK(s1.bad_frees == 1, "double free: bad_frees %llu, wanted 1",
		(unsigned long long)s1.bad_frees);
	kvt_nvme_close(st);
	free_written(w, n);
}

/* The wrong identity or generation is refused with -EBADMSG naming the block; output untouched. */
static void test_identity_refused(void **state)
{
	(void)state;
	nv_files f;
	struct kvt_nvme *st = nv_open(&f, nv_dir(), 1, 8 << 20, 8, 0);
	t_rng r;
	t_rng_seed(&r, 5);
	struct nv_written w[2];
	write_random(st, &r, w, 2, 50, 2);
	uint32_t bytes = w[0].bytes;
	unsigned char *out = t_alloc(bytes);
	memset(out, 0xa5, bytes);
	struct kvt_nvme_block_id e = w[0].id;
	e.generation++;
	void *outs[1] = {out};
	int rc = kvt_nvme_read_blocks(st, 1, &w[0].loc, &e, outs, &nv_err);
	T_CHECK(rc == -EBADMSG && strstr(nv_err.msg, "generation") &&
			strstr(nv_err.msg, "uid 0"),
		"stale generation: got %d (%s), wanted -EBADMSG naming generation and the block",
		rc, nv_err.msg);
	for (uint32_t i = 0; i < bytes; i++)
		T_CHECK(out[i] == 0xa5, "byte %u of the refused block's output was written", i);
	/* Block 1's identity at block 0's loc: other sizes (-EINVAL) or seq (-EBADMSG). */
	struct kvt_nvme_loc l = w[0].loc;
	rc = kvt_nvme_read_blocks(st, 1, &l, &w[1].id, outs, &nv_err);
	T_CHECK(rc == -EINVAL || rc == -EBADMSG, "another block's identity: got %d (%s)", rc,
		nv_err.msg);
	printf("refusals: %s\n", nv_err.msg);
	kvt_nvme_close(st);
	free(out);
	free_written(w, 2);
}

/*
 * The page-cache path: forced through KVT_NVME_BUFFERED, and on tmpfs, where kernels before 6.6
 * refuse O_DIRECT (newer ones accept it; the status line says which happened).
 */
static void test_buffered(void **state)
{
	(void)state;
	struct statfs sf;
	int tmpfs = statfs("/dev/shm", &sf) == 0 && sf.f_type == TMPFS_MAGIC_;
	for (int pass = 0; pass < 1 + tmpfs; pass++) {
		nv_files f;
		const char *dir = pass ? "/dev/shm" : nv_dir();
		nv_make_files(&f, dir, 1, 8 << 20);
		struct kvt_nvme_config cfg = {f.ptrs, f.bytes, 1,
					      4,      0,       pass ? 0 : KVT_NVME_BUFFERED};
		struct kvt_nvme *st = NULL;
		struct kvt_err err;
		int rc = kvt_nvme_open(&cfg, &st, &err);
		nv_unlink(&f);
		T_CHECK(rc == 0, "open in %s: %d (%s)", dir, rc, err.msg);
		printf("%s store: %s\n", pass ? "tmpfs" : "forced buffered", kvt_nvme_status(st));
		T_CHECK(pass || strstr(kvt_nvme_status(st), "buffered (KVT_NVME_BUFFERED)"),
			"status names the forced buffered mode: %s", kvt_nvme_status(st));
		t_rng r;
		t_rng_seed(&r, 11 + (uint64_t)pass);
		struct nv_written w[20];
		write_random(st, &r, w, 20, 100, 5);
		read_check(st, &r, w, 20);
		kvt_nvme_close(st);
		free_written(w, 20);
	}
	if (!tmpfs)
		printf("no tmpfs at /dev/shm: only the forced buffered mode was exercised\n");
}

/* Read rows [row, row + 1) of a block into out; the store's error code. */
static int hc_row(struct kvt_nvme *st, const struct kvt_nvme_loc *l,
		  const struct kvt_nvme_block_id *id, uint32_t row, void *out)
{
	struct kvt_nvme_rows q = {*l, *id, row, row + 1, out};
	return kvt_nvme_read_rows(st, 1, &q, &nv_err);
}

static uint64_t hc_hits(const struct kvt_nvme *st)
{
	struct kvt_nvme_stats s;
	kvt_nvme_get_stats(st, &s);
	return s.header_cache_hits;
}

static void flip_at(int fd, uint64_t at)
{
	unsigned char c;
	T_CHECK(pread(fd, &c, 1, (off_t)at) == 1, "pread: %s", strerror(errno));
	c ^= 0x10;
	T_CHECK(pwrite(fd, &c, 1, (off_t)at) == 1, "pwrite: %s", strerror(errno));
}

/*
 * The header cache: a repeated row read uses the cached header (counted, no header I/O) yet still
 * refuses a corrupted chunk and a chunk of an older image; free and rewrite drop the entry, so a
 * block written where another was is checked against its own header, never the old one's.
 */
struct idle_count {
	uint32_t calls, stop_at; /* stop_at: the call that says it is done (0: never) */
};

static int idle_counted(void *arg)
{
	struct idle_count *ic = arg;
	return ++ic->calls != ic->stop_at;
}

static void test_header_cache(void **state)
{
	(void)state;
	nv_files f;
	int fd;
	struct kvt_nvme *st = nv_open_ex(&f, nv_dir(), 1, 32 << 20, 8, 0, 0, &fd);
	int rc;
	t_rng r;
	t_rng_seed(&r, 77);
	struct kvt_nvme_block b = {nv_id(&r, 200, 128), NULL}; /* 25 chunks of 8 rows */
	/* hb: where the payload starts, after the header and its padding. */
	uint32_t pb = kvt_nvme_payload_bytes(&b.id), hb = kvt_nvme_data_offset(pb, kvt_nvme_alignment(st));
	unsigned char *p = nv_random_payload(&r, pb), *old = nv_random_payload(&r, pb);
	unsigned char out[512];
	b.payload = p;
	struct kvt_nvme_loc l;
	T_CHECK(kvt_nvme_write_blocks(st, 1, &b, &l, &nv_err) == 0, "write: %s", nv_err.msg);
	/* First read fills the cache, the second hits it; both deliver the right row. */
	uint64_t h0 = hc_hits(st);
	for (int t = 0; t < 2; t++) {
		rc = hc_row(st, &l, &b.id, 100, out);
		T_CHECK(rc == 0 && memcmp(out, p + 100 * 512, 512) == 0, "read %d: %d (%s)", t, rc,
			nv_err.msg);
	}
	T_CHECK(hc_hits(st) == h0 + 1, "header cache hits %llu -> %llu, wanted one more",
		(unsigned long long)h0, (unsigned long long)hc_hits(st));
	/* A flipped bit in a chunk under a cached header: refused, output untouched. */
	uint64_t at = l.offset + hb + 100 * 512 + 7;
	flip_at(fd, at);
	memset(out, 0xa5, sizeof out);
	uint64_t h1 = hc_hits(st);
	rc = hc_row(st, &l, &b.id, 100, out);
	T_CHECK(rc == -EBADMSG && strstr(nv_err.msg, "chunk 12") && hc_hits(st) == h1 + 1,
		"corrupt chunk under a cached header: %d (%s), hits %llu -> %llu", rc,
		nv_err.msg, (unsigned long long)h1, (unsigned long long)hc_hits(st));
	for (uint32_t i = 0; i < sizeof out; i++)
		T_CHECK(out[i] == 0xa5, "byte %u of a refused read was written", i);
	printf("cached header, corrupt chunk: %s\n", nv_err.msg);
	flip_at(fd, at);
	rc = hc_row(st, &l, &b.id, 100, out);
	T_CHECK(rc == 0 && memcmp(out, p + 100 * 512, 512) == 0, "repaired: %d (%s)", rc,
		nv_err.msg);
	/* A chunk of another image (a stale write) under the cached header: refused. */
	T_CHECK(hc_row(st, &l, &b.id, 16, out) == 0, "warm: %s", nv_err.msg);
	T_CHECK(pwrite(fd, old + 16 * 512, 4096, (off_t)(l.offset + hb + 16 * 512)) == 4096,
		"pwrite: %s", strerror(errno));
	h1 = hc_hits(st);
	rc = hc_row(st, &l, &b.id, 16, out);
	T_CHECK(rc == -EBADMSG && hc_hits(st) == h1 + 1, "stale chunk: %d (%s)", rc,
		nv_err.msg);
	T_CHECK(pwrite(fd, p + 16 * 512, 4096, (off_t)(l.offset + hb + 16 * 512)) == 4096,
		"pwrite: %s", strerror(errno));
	T_CHECK(hc_row(st, &l, &b.id, 16, out) == 0, "restored: %s", nv_err.msg);
	/* Free and rewrite in the same place: the old entry is gone, the new header is read. */
	kvt_nvme_free(st, 1, &l);
	struct kvt_nvme_block b2 = {b.id, old};
	b2.id.generation++;
	struct kvt_nvme_loc l2;
	T_CHECK(kvt_nvme_write_blocks(st, 1, &b2, &l2, &nv_err) == 0, "rewrite: %s", nv_err.msg);
	T_CHECK(l2.file == l.file && l2.offset == l.offset, "the rewrite reuses the freed range");
	h1 = hc_hits(st);
	rc = hc_row(st, &l, &b.id, 100, out); /* the freed block's identity */
	T_CHECK(rc == -EBADMSG && strstr(nv_err.msg, "generation") && hc_hits(st) == h1,
		"old identity after free + rewrite: %d (%s), hits %llu -> %llu", rc,
		nv_err.msg, (unsigned long long)h1, (unsigned long long)hc_hits(st));
	rc = hc_row(st, &l2, &b2.id, 100, out);
	T_CHECK(rc == 0 && memcmp(out, old + 100 * 512, 512) == 0 && hc_hits(st) == h1,
		"new block, first read: %d (%s)", rc, nv_err.msg);
	/* Cached again, then freed and rewritten once more: the new header is read, not the old. */
	T_CHECK(hc_row(st, &l2, &b2.id, 100, out) == 0 && hc_hits(st) == h1 + 1, "cached again");
	kvt_nvme_free(st, 1, &l2);
	b2.id.generation++;
	b2.payload = p;
	T_CHECK(kvt_nvme_write_blocks(st, 1, &b2, &l2, &nv_err) == 0, "rewrite: %s", nv_err.msg);
	rc = hc_row(st, &l2, &b2.id, 100, out);
	T_CHECK(rc == 0 && memcmp(out, p + 100 * 512, 512) == 0 && hc_hits(st) == h1 + 1,
		"second rewrite, first read: %d (%s)", rc, nv_err.msg);
	/* Several chunks of one uncached block in one call: its header is read once, first. */
	kvt_nvme_free(st, 1, &l2);
	T_CHECK(kvt_nvme_write_blocks(st, 1, &b2, &l2, &nv_err) == 0, "rewrite: %s", nv_err.msg);
	struct kvt_nvme_stats s0, s1;
	kvt_nvme_get_stats(st, &s0);
	unsigned char *outs = t_alloc(6 * 4096);
	struct kvt_nvme_rows q[6];
	for (uint32_t i = 0; i < 6; i++)
		q[i] = (struct kvt_nvme_rows){l2, b2.id, 8 + 32 * i, 16 + 32 * i, outs + 4096 * i};
	rc = kvt_nvme_read_rows(st, 6, q, &nv_err);
	kvt_nvme_get_stats(st, &s1);
	for (uint32_t i = 0; i < 6 && rc == 0; i++)
		T_CHECK(memcmp(outs + 4096 * i, p + (8 + 32 * i) * 512, 4096) == 0, "rows %u", i);
	T_CHECK(rc == 0 && s1.read_ios - s0.read_ios == 7 &&
			s1.header_cache_hits - s0.header_cache_hits == 6,
		"6 chunks of one block: %d (%s), %llu I/Os, %llu hits; wanted 7 and 6", rc,
		nv_err.msg, (unsigned long long)(s1.read_ios - s0.read_ios),
		(unsigned long long)(s1.header_cache_hits - s0.header_cache_hits));
	/* More blocks than entries: eviction keeps serving right; the newest stay cached. */
	enum { NB = 5000 };
	struct kvt_nvme_block *bs = t_alloc(NB * sizeof *bs);
	struct kvt_nvme_loc *ls = t_alloc(NB * sizeof *ls);
	struct kvt_nvme_rows *qs = t_alloc(NB * sizeof *qs);
	unsigned char *got = t_alloc(NB * 512);
	for (uint32_t i = 0; i < NB; i++) {
		bs[i] = (struct kvt_nvme_block){nv_id(&r, 1, 128), p + 512 * (i % 200)};
		bs[i].id.seq = i;
	}
	kvt_nvme_free(st, 1, &l2);
	T_CHECK(kvt_nvme_write_blocks(st, NB, bs, ls, &nv_err) == 0, "write %d: %s", NB, nv_err.msg);
	for (int pass = 0; pass < 2; pass++) {
		for (uint32_t i = 0; i < NB; i++)
			qs[i] = (struct kvt_nvme_rows){ls[i], bs[i].id, 0, 1, got + 512 * i};
		rc = kvt_nvme_read_rows(st, NB, qs, &nv_err);
		for (uint32_t i = 0; i < NB && rc == 0; i++)
			T_CHECK(memcmp(got + 512 * i, bs[i].payload, 512) == 0, "pass %d block %u",
				pass, i);
		T_CHECK(rc == 0, "pass %d: %d (%s)", pass, rc, nv_err.msg);
	}
	kvt_nvme_get_stats(st, &s0);
	rc = kvt_nvme_read_rows(st, 500, qs + NB - 500, &nv_err);
	kvt_nvme_get_stats(st, &s1);
	T_CHECK(rc == 0 && s1.header_cache_hits - s0.header_cache_hits == 500,
		"the 500 newest blocks: %d, %llu hits", rc,
		(unsigned long long)(s1.header_cache_hits - s0.header_cache_hits));
	/* Work while the reads are in flight: called while the queue (8) is full, until it says it
	 * is done, and the reads deliver the same rows. */
	for (int stop = 0; stop < 2; stop++) {
		struct idle_count ic = {.stop_at = stop ? 3 : 0};
		const struct kvt_nvme_idle idle = {idle_counted, &ic};
		memset(got, 0, NB * 512);
		for (uint32_t i = 0; i < NB; i++)
			qs[i] = (struct kvt_nvme_rows){ls[i], bs[i].id, 0, 1, got + 512 * i};
		rc = kvt_nvme_read_rows_idle(st, 1000, qs, &idle, &nv_err);
		for (uint32_t i = 0; i < 1000 && rc == 0; i++)
			T_CHECK(memcmp(got + 512 * i, bs[i].payload, 512) == 0, "idle read %u", i);
		T_CHECK(rc == 0 && (stop ? ic.calls == 3 : ic.calls >= 1000 / 8 - 1),
			"1000 reads at queue depth 8 with idle work stopping at %u: %d (%s), %u "
			"calls", ic.stop_at, rc, nv_err.msg, ic.calls);
	}
	close(fd);
	kvt_nvme_close(st);
	free(bs);
	free(ls);
	free(qs);
	free(got);
	free(outs);
	free(p);
	free(old);
}

/* Bad configurations are refused with -EINVAL and the value named. */
static void test_bad_config(void **state)
{
	(void)state;
	const char *paths[1] = {"./kvt-nvme-never-created"};
	uint64_t bytes[1] = {1 << 20};
	struct kvt_nvme_config cfg = {paths, bytes, 1, 5000, 0, 0};
	struct kvt_nvme *st = (struct kvt_nvme *)1;
	struct kvt_err err;
	int rc = kvt_nvme_open(&cfg, &st, &err);
	T_CHECK(rc == -EINVAL && st == NULL && strstr(err.msg, "queue_depth = 5000"),
		"queue depth 5000: got %d (%s)", rc, err.msg);
	cfg.queue_depth = 4;
	cfg.n_files = 0;
	rc = kvt_nvme_open(&cfg, &st, &err);
	T_CHECK(rc == -EINVAL && strstr(err.msg, "n_files = 0"), "no files: got %d (%s)", rc, err.msg);
	const char *bad[1] = {"/nonexistent-dir/kvt"};
	cfg.n_files = 1;
	cfg.paths = bad;
	rc = kvt_nvme_open(&cfg, &st, &err);
	T_CHECK(rc == -EIO && strstr(err.msg, "/nonexistent-dir/kvt") && strstr(err.msg, "No such file"),
		"missing directory: got %d (%s)", rc, err.msg);
}

int main(void)
{
	/* The checksum and the format need no io_uring: they run (and must pass) everywhere. */
	const struct CMUnitTest pure[] = {
		cmocka_unit_test(test_crc32c),
		cmocka_unit_test(test_format),
	};
	int failed = cmocka_run_group_tests_name("nvme format", pure, NULL, NULL);
	if (failed)
		return failed;
	nv_skip_unless_available();
	const struct CMUnitTest store[] = {
		cmocka_unit_test(test_bad_config),
		cmocka_unit_test(test_round_trip),
		cmocka_unit_test(test_enospc_free_reuse),
		cmocka_unit_test(test_identity_refused),
		cmocka_unit_test(test_header_cache),
		cmocka_unit_test(test_buffered),
	};
	return cmocka_run_group_tests_name("nvme store", store, NULL, NULL);
}
