/*
 * The glibc versions of the dynamic-loader functions the core calls (dlopen, dlsym, dlclose,
 * dlerror), so that one build runs on glibc 2.28 and later (the manylinux_2_28 wheels).
 *
 * glibc 2.34 moved these functions from libdl.so.2 into libc.so.6 and gave them a new default
 * symbol version, GLIBC_2.34. Compiled against glibc 2.34 or later, an extension binds to that
 * version and the dynamic loader of an older glibc refuses to load it. The first versions
 * (GLIBC_2.2.5 on x86_64, GLIBC_2.17 on aarch64) are still exported by every glibc: before 2.34 by
 * libdl.so.2, which setup.py links, and from 2.34 on by libc.so.6 as compatibility symbols, which
 * behave the same. The .symver directives below bind the references of this translation unit to
 * them. Against an older glibc, or on another C library or architecture, this header is just
 * <dlfcn.h>.
 */
#ifndef LLM_DATADIST_DD_GLIBC_H
#define LLM_DATADIST_DD_GLIBC_H

#include <dlfcn.h>  /* defines __GLIBC__ and __GLIBC_MINOR__ (through <features.h>) */

#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 34))
#  if defined(__x86_64__) && defined(__LP64__)
#    define DD_GLIBC_DL_VERSION "GLIBC_2.2.5"
#  elif defined(__aarch64__)
#    define DD_GLIBC_DL_VERSION "GLIBC_2.17"
#  endif
#  ifdef DD_GLIBC_DL_VERSION
__asm__(".symver dlopen,dlopen@" DD_GLIBC_DL_VERSION);
__asm__(".symver dlsym,dlsym@" DD_GLIBC_DL_VERSION);
__asm__(".symver dlclose,dlclose@" DD_GLIBC_DL_VERSION);
__asm__(".symver dlerror,dlerror@" DD_GLIBC_DL_VERSION);
#  endif
#endif

#endif /* LLM_DATADIST_DD_GLIBC_H */
