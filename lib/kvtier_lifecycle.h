/* SPDX-License-Identifier: MIT */
/*
 * kvtier: the lifecycle of a sequence (speculative-decoding rollback, prefix sharing, row transfer
 * in and out of a runtime's buffers). Part of kvtier.h, which includes it where its declarations
 * belong (after kvt_cache and the sequence calls); include kvtier.h, not this file. The
 * conventions at the top of kvtier.h hold for every function here.
 */
#ifndef KVTIER_LIFECYCLE_H
#define KVTIER_LIFECYCLE_H

#ifndef KVTIER_H
#error "include kvtier.h, which includes kvtier_lifecycle.h"
#endif

/* ---- the lifecycle of a sequence (speculative decoding, prefix sharing, row transfer) ---- */

/*
 * Drop the last `n_tokens` tokens of `seq` on every layer (speculative-decoding rollback,
 * transformers' crop): the rows, their index entries and the window. The sequence goes back to the
 * state it had at the shorter length: tokens that were indexed since return to the window, and
 * appending the same tokens again gives, bit for bit, the attention of a sequence that never had
 * the dropped ones, made by the same calls (prefill chunks and appends) up to that length. The
 * index entries kept are unchanged, and so are the centroids unless the prefill chunk or flush that
 * fixed them is dropped entirely (then the next chunk or flush fixes them anew); a truncation into
 * the first prefill chunk keeps centroids computed over the whole chunk. Selections of the sequence
 * are dropped (kvt_gather needs a new kvt_select). Whole blocks past the new length go back to the
 * host tier (or free their NVMe space); a block still held by a forked sequence stays with it, and
 * a shared block that becomes the partial last block is copied first (appends write it).
 * n_tokens == 0 changes nothing. Returns 0. All or nothing.
 * Errors: -EINVAL (cache NULL; n_tokens more than the sequence holds on some layer: the text names
 * the layer and its length), -ENOENT (not open), -ENOSPC and -ENOMEM (a block to copy); when a
 * spilled block holds rows of the new window or its last block, the sequence is restored first
 * (kvt_seq_restore's errors; a failed restore changes nothing: the sequences it or the copies
 * of shared blocks spilled under KVT_SPILL_LRU are read back).
 * CUDA backend: synchronizes the device (blocks may be freed under queued work; not capturable:
 * -EINVAL while `stream` is being captured); the window ring's rows of tokens returning to the
 * window are copied back from the host tier on `stream`. -EIO when that copy fails, a device
 * failure after which rings of the sequence may hold dropped rows, the sequence stays restored,
 * and a sequence spilled to make room for that restore may stay spilled (the text says which).
 * Thread safety: as every call on the cache.
 */
KVT_API int kvt_seq_truncate(kvt_cache *cache, uint32_t seq, uint32_t n_tokens, void *stream);

/*
 * Open a new sequence *child holding what `parent` holds on every layer (prefix sharing, beam or
 * parallel sampling). The parent's full host-tier blocks, and the NVMe copies of its spilled ones,
 * are shared, not copied: no row is copied until one side would write it, i.e. the partial last
 * block of each layer and KV head, which the next append writes, is copied now. The index (codes,
 * sigma, beta), centroids and window are copied, not shared (on the CUDA backend from device
 * memory, never rebuilt from the host tier). No selection is copied. A shared block is spilled
 * once, for all its holders, and restored once; its host memory or NVMe space is freed when its last
 * holder lets it go: closing or truncating the parent leaves the child intact, and a block no
 * sequence holds any more is never read by another. kvt_seq_bytes counts a shared block in each
 * holder, kvt_stats.host_bytes_used once.
 * On success *child receives the new id. All or nothing: on failure no sequence is opened and the
 * parent is as it was.
 * Errors: -EINVAL (NULL), -ENOENT (parent not open), -ENOSPC (max_seqs open, or the host tier
 * cannot hold the copied blocks: KVT_SPILL_LRU spills others first, undone on failure), -ENOMEM;
 * CUDA backend: -EIO, and -EINVAL while `stream` is being captured (the call synchronizes).
 * Thread safety: as every call on the cache.
 */
KVT_API int kvt_seq_fork(kvt_cache *cache, uint32_t parent, uint32_t *child, void *stream);

/*
 * Copy the rows of tokens [from, to) of `seq` on `layer` into k and v, dense
 * [to - from, n_kv_heads, head_dim] each (dtype): e.g. to hand a prefix to another engine. Rows of
 * spilled blocks are read from NVMe and verified (through the block cache on the CPU backend; the
 * CUDA backend restores the sequence first, when the range has such rows: rows stored after a
 * spill are in host memory and read as they are). Returns to - from.
 * Errors: -EINVAL (NULL, layer, to <= from, to past the sequence's length: the text names the
 * values), -ENOENT; for spilled rows the NVMe read's errors (-EIO, -EBADMSG naming the block) and
 * -ENOSPC (CPU: block cache too small; CUDA: kvt_seq_restore's), after which k and v may be partly
 * written (never with unverified bytes). The sequence is not changed (the CUDA backend may leave
 * it restored); the read counts as a use for KVT_SPILL_LRU, and not in kvt_stats.rows_fetched.
 * CUDA backend: k and v are device pointers; the copies are queued on `stream`.
 * Thread safety: as every call on the cache.
 */
KVT_API int kvt_seq_read_rows(kvt_cache *cache, uint32_t seq, uint32_t layer, uint32_t from,
			      uint32_t to, void *k, void *v, void *stream);

/*
 * Append the rows of tokens [from, to) of `seq` on `layer`, computed elsewhere (disaggregated
 * prefill, a prefix moved from another engine): from must be the sequence's length on the layer.
 *   k, v: [to - from, n_kv_heads, head_dim] (dtype)
 * The rows are stored and indexed as a kvt_prefill chunk without queries is (the first chunk of a
 * layer fixes the key centroid, and a zero query centroid): the same call. Returns to - from.
 * Errors: -EINVAL (NULL, layer, to <= from, from not the length, to past 2^31 - 1, non-finite key),
 * -ENOENT, and kvt_prefill's (-ENOSPC, -ENOMEM, automatic spill I/O). All or nothing.
 * CUDA backend: as kvt_prefill (asynchronous on `stream`).
 * Thread safety: as every call on the cache.
 */
KVT_API int kvt_seq_write_rows(kvt_cache *cache, uint32_t seq, uint32_t layer, uint32_t from,
			       uint32_t to, const void *k, const void *v, void *stream);

/*
 * Where the rows of a token range lie in a caller's buffer, for kvt_seq_read_rows_at and
 * kvt_seq_write_rows_at: a paged K/V buffer given its slot mapping (vLLM: k, v of
 * [n_slots, n_kv_heads, head_dim], slot_mapping[i] the slot of token from + i), or a strided view of
 * a dense one (slot_mapping NULL). Token i, KV head h starts at element
 * slot(i) * slot_stride + h * head_stride of k (and of v); its head_dim elements are contiguous.
 * Zero in a field means the default, so `{ sizeof(kvt_rows_layout) }` is the dense layout of
 * kvt_seq_read_rows.
 */
typedef struct kvt_rows_layout {
	uint32_t size;  /* sizeof(kvt_rows_layout): at least up to head_stride */
	uint32_t flags; /* must be 0 */
	/* [to - from] host array (whatever the backend), or NULL: slot(i) = i. On read a slot of -1
	 * skips the token (its rows are not written) and the other slots must be distinct; on write
	 * every slot must be >= 0 and may repeat (the same rows stored twice). Every slot must be
	 * <= the largest whose rows an address of ptrdiff_t range reaches (the error names it). */
	const int64_t *slot_mapping;
	/* elements between slots; 0: n_kv_heads * head_stride. Must be at least
	 * (n_kv_heads - 1) * head_stride + head_dim, so that no two slots overlap. */
	uint64_t slot_stride;
	/* elements between the KV heads of a slot; 0: head_dim. Must be at least head_dim. */
	uint64_t head_stride;
} kvt_rows_layout;

/*
 * kvt_seq_read_rows, with the rows placed in k and v as `layout` says (NULL: dense, the same call).
 * Token from + i goes to slot slot_mapping[i] (skipped when -1). Returns to - from (skipped tokens
 * included). Writes nothing of k and v outside the slots and heads named; the bytes between heads
 * of a strided slot are left as they were.
 * Errors: kvt_seq_read_rows's, and -EINVAL for the layout (size too small, unknown flags, a stride
 * below its minimum, a slot below -1 or out of range, two tokens on one slot: the text names the
 * field, the index and the value); -ENOMEM (the check for repeated slots needs 2 n 64-bit words;
 * on the CUDA backend, device memory for a dense copy of the rows and the mapping).
 * On the CUDA backend k and v are device memory: the rows are read densely into a device scratch
 * of the cache, which a kernel scatters into the slots, on `stream`; the mapping is uploaded from
 * the host array (a pageable copy: the array may change once the call returns), and growing the
 * scratch synchronizes the device (refused while `stream` is captured into a graph).
 * A failed call writes nothing of k and v, except after a failed NVMe read as kvt_seq_read_rows.
 * Thread safety: as every call on the cache.
 */
KVT_API int kvt_seq_read_rows_at(kvt_cache *cache, uint32_t seq, uint32_t layer, uint32_t from,
				 uint32_t to, void *k, void *v, const kvt_rows_layout *layout,
				 void *stream);

/*
 * kvt_seq_write_rows, with the rows taken from k and v as `layout` says (NULL: dense, the same
 * call): ingest of new rows straight from a runtime's paged K/V buffer. The rows are gathered into
 * a dense buffer of 2 (to - from) n_kv_heads head_dim elements first (host memory on the CPU
 * backend; on the CUDA backend a device scratch of the cache, by a kernel on `stream`, as
 * kvt_seq_read_rows_at's), then stored and indexed exactly as kvt_seq_write_rows stores and indexes
 * the same rows given dense (bit for bit). Returns to - from. Errors: kvt_seq_write_rows's, -EINVAL
 * for the layout (as kvt_seq_read_rows_at; a slot of -1 is refused), -ENOMEM (the dense buffer).
 * All or nothing.
 * Thread safety: as every call on the cache.
 */
KVT_API int kvt_seq_write_rows_at(kvt_cache *cache, uint32_t seq, uint32_t layer, uint32_t from,
				  uint32_t to, const void *k, const void *v,
				  const kvt_rows_layout *layout, void *stream);

/*
 * The error status of `seq` into *status: 0, or the negative code of an error found in a step
 * that served it after the step's call had returned, with its text in `text` (at most text_size
 * bytes with the NUL; may be NULL when text_size is 0; "" when none). On the CUDA backend the
 * kernels record such errors without stopping, and the device is not synchronized to look for
 * them: a sequence one of whose queries gave a non-finite estimated score (a query or key not
 * finite or too large: that step's selection for it was empty) is put in error by the next call
 * on the cache, this one included. The CPU backend refuses such inputs at the call, so its
 * sequences are never in error.
 * A sequence in error fails every call that would compute with or store into it (kvt_prefill,
 * kvt_append, kvt_attend, kvt_select, kvt_gather, kvt_extend, kvt_seq_write_rows, kvt_seq_fork:
 * the code and text of its status, kvt_last_error_entry naming its index in a batch) before
 * anything changes, while the other sequences of a batch are served as before; so one bad
 * request does not fail the batches of the others. Reading its rows, spilling and restoring it
 * still work. kvt_seq_truncate of at least one token clears the status (roll back to before the
 * bad token and go on); kvt_seq_close too; an error of a sequence closed or truncated back before
 * it was found is dropped.
 * Limits on the CUDA backend: the kernels keep the first such error between two calls that find
 * one, so a second sequence whose query went bad in that window is not put in error (its step's
 * selection was empty too); a kvt_select whose own step is found in error fails as a whole
 * (naming the entry); the calls must reach the device in the order they were made (one stream per
 * cache, or streams the caller orders); and once a step has been captured into a CUDA graph the
 * cache puts no sequence in error (a replay raises between eager calls, which cannot be told
 * apart): kernel errors then fail the next call and name no entry, as any unattributed one.
 * Returns 0. Errors: -EINVAL (NULL), -ENOENT (not open), and an unattributed error of the CUDA
 * kernels (as any call). Thread safety: as every call on the cache.
 */
KVT_API int kvt_seq_status(kvt_cache *cache, uint32_t seq, int *status, char *text,
			   size_t text_size);

#endif /* KVTIER_LIFECYCLE_H */
