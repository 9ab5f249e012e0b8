/* SPDX-License-Identifier: MIT */
/*
 * kvtier: the decode step a CUDA graph replays across steps. Part of kvtier.h, which includes it
 * after the compute calls; include kvtier.h, not this file. The conventions at the top of
 * kvtier.h hold for every function here.
 *
 * A runtime captures one graph per batch size and replays it every step while the sequences grow.
 * kvt_attend bakes its batch, lengths and selection inputs into a captured graph; kvt_attend_graph
 * instead reads which sequence each batch slot holds (and, to check them, the lengths the runtime
 * expects) from buffers the caller owns, when the step runs. The runtime writes those buffers
 * before each replay, as it writes its own inputs. kvt_append stays an eager call between replays
 * (it allocates host-tier blocks and schedules window flushes on the host): split the captured
 * forward pass at kvt_append, as piecewise graphs split it at attention (doc/runtimes.md).
 */
#ifndef KVTIER_GRAPH_H
#define KVTIER_GRAPH_H

#ifndef KVTIER_H
#error "include kvtier.h, which includes kvtier_graph.h"
#endif

/*
 * The batch of a kvt_attend_graph call. The arrays are device memory on the CUDA backend (read by
 * the kernels when the step runs, so a replayed graph reads their contents at replay time) and host
 * memory on the cpu backend (read when the call runs).
 *   n_slots: rows of q and out; at most the max_slots of kvt_graph_reserve.
 *   seqs:    [n_slots] int32: the sequence id (kvt_seq_open) each slot holds; < 0 pads the slot
 *            when valid is NULL (with valid, valid alone pads: a valid slot whose id is < 0 is a
 *            slot error, its sequence not open).
 *   lengths: [n_slots] int32, or NULL: the tokens the runtime expects the slot's sequence to
 *            hold on the layer (kvt_seq_length); a valid slot whose sequence holds another count
 *            is an error.
 *   valid:   [n_slots] uint8, or NULL (every slot whose seqs entry is >= 0 is valid): 0 pads the
 *            slot.
 * A padded slot is a no-op: nothing of it is read (its q row may hold anything) and its out row is
 * left as it was. The structure has no size field: a later version adds calls, not fields.
 */
typedef struct kvt_graph_batch {
	uint32_t n_slots;
	uint32_t pad; /* must be 0 */
	const int32_t *seqs;
	const int32_t *lengths;
	const uint8_t *valid;
} kvt_graph_batch;

/*
 * Size everything a decode step needs, once, for batches of up to `max_slots` slots whose sequences
 * hold up to `max_tokens` tokens on a layer, and from then on keep a per-sequence record of every
 * open sequence on the device (refreshed by the calls that change a sequence), which
 * kvt_attend_graph reads. After it, no kvt_attend or kvt_attend_graph within those bounds
 * allocates, and both lay out their work by the reserved bounds instead of the batch's, so an
 * eager kvt_attend and a replayed kvt_attend_graph of the same sequences give bit-equal outputs
 * (the CUDA backend's attention splits its rows by the bound; the cpu backend's results never
 * depend on it). A call within the bounds is as fast as before for short contexts, up to the
 * launch of blocks sized for max_tokens that find no rows.
 * Calling it again replaces the bounds (max_slots == 0 drops the reservation; graphs captured
 * before either must not be replayed after it). kvt_attend_graph pads a slot whose sequence holds
 * more than max_tokens and reports the error. CUDA backend: while a reservation stands, a
 * kvt_attend, kvt_select or kvt_gather of a batch beyond its bounds (more sequences, or more
 * tokens) fails with -E2BIG naming both: growing the scratch would free memory captured graphs
 * read, so reserve larger bounds first (the cpu backend has no such bound).
 * Returns 0. Errors: -EINVAL (cache NULL, max_slots above max_seqs, max_tokens == 0 with
 * max_slots != 0 or above 2^24 - 1: the text names the value and the limit; refused while `stream`
 * is being captured), -ENOMEM (the CUDA backend then holds no reservation: graphs captured under
 * an earlier one must not be replayed; the cpu backend keeps the earlier one). CUDA backend:
 * allocates device memory and synchronizes the device; call it before capturing.
 */
KVT_API int kvt_graph_reserve(kvt_cache *cache, uint32_t max_slots, uint32_t max_tokens,
			      void *stream);

/*
 * kvt_attend over the batch described by `batch` (see kvt_graph_batch): for each valid slot i, the
 * decode step of sequence batch->seqs[i] with query row i of q into row i of out, exactly as
 * kvt_attend of the valid slots' sequences computes it (bit for bit, after kvt_graph_reserve). On
 * the CUDA backend the selections of a kvt_attend_graph are not kept for kvt_gather, and its steps
 * are counted in kvt_stats' device counters (fetch, hot cache, budget) but not in `steps`; the cpu
 * backend runs one kvt_attend over the valid slots' sequences, whose selections, counters and
 * `steps` are kvt_attend's.
 *   q: [n_slots, n_q_heads, head_dim] (dtype); out: [n_slots, n_q_heads, head_dim] (out_dtype)
 * Needs kvt_graph_reserve with max_slots >= n_slots.
 * Slot errors (a sequence id that is not open or repeats an earlier slot's, a length that differs
 * from the sequence's, a sequence longer than max_tokens, a sequence in error (kvt_seq_status), a
 * sequence with blocks on NVMe on the CUDA backend, which must be restored before it is in a
 * graph's batch): the cpu backend fails the
 * call (-EINVAL naming the slot in kvt_last_error_entry) before anything is written; the CUDA
 * backend, which sees them on the device, pads that slot and fails the next call on the cache with
 * -EINVAL naming the slot, the layer and the cause, as it reports a kernel error.
 * Returns 0. Errors: -EINVAL (NULL cache, batch, seqs, q or out; pad != 0; n_slots == 0 or above
 * the reservation; no reservation; layer), the slot errors above, and kvt_attend's (the cpu
 * backend's one kvt_attend is all or nothing, as kvt_attend is: after such an error no sequence
 * changed but for the dropped selections kvt_attend documents, and out is untouched where padded
 * slots lie between valid ones (the rows are packed, then scattered on success; -ENOMEM if the
 * packing cannot be allocated), else may be partly written; kvt_last_error_entry gives the slot,
 * and the text names it before that kvt_attend's own text, whose entries count the valid slots).
 * CUDA backend: asynchronous on `stream`, no host synchronization and no allocation: capture it
 * after a warm-up call at the same n_slots (which freezes the self-sized hot cache, as for
 * kvt_attend), then replay while kvt_append (eager, between replays) grows the sequences; the
 * captured step waits on the device for the window flushes those appends start. An error the
 * device recorded before (a replay's slot error, say) cannot be read out during a capture (that
 * synchronizes the device): the call being captured then fails with -EIO, captures nothing and
 * leaves the capture valid, and the next call outside the capture reports the error itself.
 */
KVT_API int kvt_attend_graph(kvt_cache *cache, uint32_t layer, const kvt_graph_batch *batch,
			     const void *q, void *out, void *stream);

#endif /* KVTIER_GRAPH_H */
