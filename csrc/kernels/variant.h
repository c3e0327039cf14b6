// The extension's namespace. Every declaration lives in flash_mla::FLASH_MLA_VARIANT, an inline namespace, so that
// flash_mla::X names it as usual. Builds meant to be timed side by side in one process
// (benchmarks/sxs_variants.py --same-process) set it apart (FLASH_MLA_VARIANT=name in setup.py's environment):
// each build's kernels and host functions then carry names of their own (profiles tell them apart), and the
// binding reports the name, by which the timing process checks that it loaded each build, not one build twice.
#pragma once

#ifndef FLASH_MLA_VARIANT
#define FLASH_MLA_VARIANT build
#endif

#define FLASH_MLA_NAMESPACE_BEGIN \
  namespace flash_mla {           \
  inline namespace FLASH_MLA_VARIANT {
#define FLASH_MLA_NAMESPACE_END \
  }                             \
  }

#define FLASH_MLA_STRINGIFY_(x) #x
#define FLASH_MLA_STRINGIFY(x) FLASH_MLA_STRINGIFY_(x)
#define FLASH_MLA_VARIANT_NAME FLASH_MLA_STRINGIFY(FLASH_MLA_VARIANT)
