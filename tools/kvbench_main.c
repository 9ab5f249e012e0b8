/* SPDX-License-Identifier: MIT */
/* kvbench's executable: everything else lives in the kvbench static library, which the tests link
 * too (kvbench_main is their entry point into a whole run). */
#include "kvbench.h"

int main(int argc, char **argv)
{
	return kvbench_main(argc, argv);
}
