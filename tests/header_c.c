/* SPDX-License-Identifier: MIT */
/* The public header on its own, as strict C11: built with -std=c11 -pedantic -Werror. */
#include "kvtier.h"

int main(void)
{
	kvt_config cfg = KVT_CONFIG_INIT;
	if (cfg.size != sizeof(kvt_config) || cfg.dtype != 0 || cfg.pad3 != 0 || cfg.nvme_flags != 0 ||
	    KVT_CONFIG_SIZE_VER0 > sizeof(kvt_config))
		return 1;
	/* linked against the installed library: the exported names resolve */
	return kvt_version_number() == KVT_VERSION_NUMBER && kvt_strerror(0) != 0 ? 0 : 1;
}
