/* SPDX-License-Identifier: MIT */
/*
 * kvbench: capacity experiments, fetch-path stress and trace replay for kvtier (doc/kvbench.md).
 * One option parser for every mode; each mode then builds its own context on the shared spine
 * (kvbench.h lists the files and contexts).
 */
#include "kvbench.h"

#include <stdlib.h>

/* The default experiment or --capacity: one synthetic run, then its summary or JSON. */
static int single_run(opts *o)
{
	static kb_run b;
	kb_phases ph = {.n = 0};
	b.o = *o;
	uint64_t t0 = now_ns();
	setup(&b);
	if (o->capacity)
		capacity_run(&b, &ph);
	else
		standard_run(&b);
	double wall = (double)(now_ns() - t0) / 1e9;
	if (o->json)
		print_json(&b, o->capacity ? &ph : NULL, wall);
	else
		print_summary(&b, o->capacity ? &ph : NULL, wall);
	teardown(&b);
	return 0;
}

int kvbench_main(int argc, char **argv)
{
	opts o;
	int rc;
	parse_args(argc, argv, &o);
	if (o.trace_dir)
		rc = trace_main(&o);
	else if (o.stress_s)
		rc = stress_main(&o);
	else if (o.n_sweep || (o.baselines && !o.capacity && !o.plan))
		rc = sweep_main(&o);
	else if (o.plan)
		rc = plan_main(&o);
	else
		rc = single_run(&o);
	created_files_end(rc == 0); /* a sweep's CSV and SVGs, a replay's --hot-log */
	opts_free(&o);
	return rc;
}
