// SPDX-License-Identifier: MIT
// The public header compiled as C++11 (-pedantic -Werror): extern "C", and KVT_CONFIG_INIT (a
// value-initialized config with its size set).
#include "kvtier.h"

int main()
{
	kvt_config cfg = KVT_CONFIG_INIT;
	cfg.n_layers = 1;
	kvt_cache *cache = nullptr;
	kvt_cache_destroy(cache);
	if (cfg.size != sizeof(kvt_config) || cfg.p != 0.0f || cfg.pad3 != 0 ||
	    KVT_CONFIG_SIZE_VER0 > sizeof(kvt_config))
		return 1;
	return kvt_version_number() == KVT_VERSION_NUMBER ? 0 : 1;
}
