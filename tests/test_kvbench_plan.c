/* SPDX-License-Identifier: MIT */
/*
 * kvbench's capacity arithmetic (tools/kvbench_plan.c) against cases computed by hand, each written
 * out below so that a reader can redo it.
 */
#include "common.h"

#include "kvbench_plan.h"

#define GiB (1ull << 30)
#define MiB (1ull << 20)

/* Llama-3.1-8B attention (32 layers, 8 KV heads, D = 128), 32K context, library defaults (4 sinks,
 * window 64, flush 64, hot cache 256 MiB), an 80 GiB GPU holding 16 GiB of weights. */
static kb_plan_in llama8b(void)
{
	return (kb_plan_in){.layers = 32, .kv_heads = 8, .head_dim = 128, .context = 32768,
			    .sinks = 4, .window = 64, .flush = 64, .gpu_bytes = 80 * GiB,
			    .weights_bytes = 16 * GiB, .hot_bytes = 256 * MiB,
			    .host_bytes = 512 * GiB, .nvme_bytes = 0};
}

#define EQ(field, want)                                                                            \
	T_CHECK((uint64_t)(p.field) == (uint64_t)(want), "%s: %s got %llu, wanted %llu", name,      \
		#field, (unsigned long long)(p.field), (unsigned long long)(want))

/*
 * Host-bound. kv_free = 80 - 16 = 64 GiB = 68719476736.
 * Full K/V: 4 * 128 * 8 * 32 = 131072 B per token; 68719476736 / 131072 = 524288 tokens;
 *   524288 / 32768 = 16 sequences.
 * kvtier HBM: index (128/8 + 4) * 8 * 32 = 5120 B per token; indexed tokens 32768 - 4 - 64 = 32700;
 *   window ring (64 + 2 * 64) * 512 * 256 = 25165824; selections as bits 4 * (ceil(32700 / 32) +
 *   ceil(32700 / 8192) + 1) * 256 = 4 * (1022 + 4 + 1) * 256 = 1051648; per sequence
 *   32700 * 5120 + 25165824 + 1051648 = 193641472; HBM left after the hot cache
 *   68719476736 - 268435456 = 68451041280; 68451041280 / 193641472 = 353.5 -> 353 sequences.
 * Host: block 256 * 512 = 131072 B; 512 GiB / 131072 = 4194304 blocks; a sequence is
 *   32768 / 256 * 8 * 32 = 32768 blocks -> 128 sequences. No NVMe: kvtier holds min(353, 128) =
 *   128 sequences, 128 * 32768 = 4194304 tokens, limited by the host tier.
 */
static void test_host_bound(void **state)
{
	(void)state;
	const char *name = "llama8b-32K-host512G";
	kb_plan_in in = llama8b();
	kb_plan p;
	T_CHECK(kb_plan_compute(&in, &p) == 0, "%s: rejected", name);
	EQ(kv_free, 68719476736ull);
	EQ(full_token_bytes, 131072);
	EQ(full_tokens, 524288);
	EQ(full_seqs, 16);
	EQ(index_token_bytes, 5120);
	EQ(index_tokens, 32700);
	EQ(window_seq_bytes, 25165824);
	EQ(sel_seq_bytes, 1051648);
	EQ(hbm_seq_bytes, 193641472);
	EQ(hbm_seqs, 353);
	EQ(block_bytes, 131072);
	EQ(seq_blocks, 32768);
	EQ(host_seqs, 128);
	EQ(tier_seqs, 128);
	EQ(kvt_seqs, 128);
	EQ(kvt_tokens, 4194304);
	T_CHECK(!strcmp(p.limit, "host"), "%s: limit got %s, wanted host", name, p.limit);
}

/*
 * The same with 2 TiB of NVMe. An NVMe block: header 64 + 4 * (131072 / 4096) = 192 B, rounded
 * to 4096, plus the 131072 B payload = 135168 B; 2^41 / 135168 = 16268815 blocks.
 * Host + NVMe: (4194304 + 16268815) / 32768 = 624.5 -> 624 sequences; HBM allows 353, so kvtier
 * holds 353 sequences (353 * 32768 = 11567104 tokens), limited by HBM: 22.1 x the 16 of full K/V.
 * The GPU alone (hbm_*): the same 353 sequences, 353 * 32768 = 11567104 blocks, of which the host
 * tier takes 4194304 (512 GiB = 549755813888 B) and NVMe the other 7372800 at 135168 B each =
 * 996566630400 B (928.1 GiB).
 */
static void test_hbm_bound(void **state)
{
	(void)state;
	const char *name = "llama8b-32K-host512G-nvme2T";
	kb_plan_in in = llama8b();
	in.nvme_bytes = 2048 * GiB;
	kb_plan p;
	T_CHECK(kb_plan_compute(&in, &p) == 0, "%s: rejected", name);
	EQ(nvme_block_bytes, 135168);
	EQ(tier_seqs, 624);
	EQ(hbm_seqs, 353);
	EQ(kvt_seqs, 353);
	EQ(kvt_tokens, 11567104);
	EQ(full_seqs, 16);
	EQ(hbm_tokens, 11567104);
	EQ(hbm_host_bytes, 549755813888ull);
	EQ(hbm_nvme_bytes, 996566630400ull);
	T_CHECK(!strcmp(p.limit, "HBM"), "%s: limit got %s, wanted HBM", name, p.limit);
}

/*
 * Weights larger than the GPU: nothing is left for K/V, in either scheme (kv_free 0, 0 sequences).
 */
static void test_no_room(void **state)
{
	(void)state;
	const char *name = "weights-exceed-gpu";
	kb_plan_in in = llama8b();
	in.gpu_bytes = 8 * GiB;
	kb_plan p;
	T_CHECK(kb_plan_compute(&in, &p) == 0, "%s: rejected", name);
	EQ(kv_free, 0);
	EQ(full_tokens, 0);
	EQ(full_seqs, 0);
	EQ(hbm_seqs, 0);
	EQ(kvt_seqs, 0);
}

/*
 * A context inside sinks + window (50 < 4 + 64), one layer, one KV head, D = 64, 1 MiB of HBM, no
 * weights or hot cache, 1 MiB of host tier.
 * Full K/V: 256 B per token; 1048576 / 256 = 4096 tokens; 4096 / 50 = 81 sequences.
 * kvtier: nothing indexed; window ring (64 + 2 * 64) * 256 = 49152 B, the (empty) selection
 * 4 * (0 + 1 + 1) = 8 B; 1048576 / 49160 = 21.3 -> 21 by HBM. Host: block 256 * 256 = 65536 B, 16 blocks, one per sequence -> 16. kvtier:
 * min(21, 16) = 16 sequences, 800 tokens, by the host tier: fewer than full K/V, since a short
 * context gains nothing from an index and pays for a whole block.
 */
static void test_short_context(void **state)
{
	(void)state;
	const char *name = "context-50-D64";
	kb_plan_in in = {.layers = 1, .kv_heads = 1, .head_dim = 64, .context = 50, .sinks = 4,
			 .window = 64, .flush = 64, .gpu_bytes = MiB, .host_bytes = MiB};
	kb_plan p;
	T_CHECK(kb_plan_compute(&in, &p) == 0, "%s: rejected", name);
	EQ(full_token_bytes, 256);
	EQ(full_tokens, 4096);
	EQ(full_seqs, 81);
	EQ(index_tokens, 0);
	EQ(window_seq_bytes, 49152);
	EQ(sel_seq_bytes, 8);
	EQ(hbm_seq_bytes, 49160);
	EQ(hbm_seqs, 21);
	EQ(block_bytes, 65536);
	EQ(seq_blocks, 1);
	EQ(host_seqs, 16);
	EQ(kvt_seqs, 16);
	EQ(kvt_tokens, 800);
	/* the GPU alone: 21 sequences (1050 tokens), 16 blocks in the host tier (1 MiB) and 5 on
	 * NVMe, each 65536 B of payload after a 4096-B header sector = 69632 B: 348160 B */
	EQ(hbm_tokens, 1050);
	EQ(hbm_host_bytes, MiB);
	EQ(nvme_block_bytes, 69632);
	EQ(hbm_nvme_bytes, 348160);
}

/* A zero count or a head dim the library does not serve is refused. */
static void test_bad_shape(void **state)
{
	(void)state;
	kb_plan_in in = llama8b();
	kb_plan p;
	in.head_dim = 100;
	T_CHECK(kb_plan_compute(&in, &p) == -1, "head_dim 100 accepted");
	in = llama8b();
	in.context = 0;
	T_CHECK(kb_plan_compute(&in, &p) == -1, "context 0 accepted");
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_host_bound),     cmocka_unit_test(test_hbm_bound),
		cmocka_unit_test(test_no_room),        cmocka_unit_test(test_short_context),
		cmocka_unit_test(test_bad_shape),
	};
	return cmocka_run_group_tests(tests, NULL, NULL);
}
