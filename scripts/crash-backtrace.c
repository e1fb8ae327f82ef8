/* crash-backtrace.c - a native backtrace from a crash, where no debugger is.
 *
 * The GPU machines have no gdb. Preloaded, this prints the crashing thread's
 * stack as module+offset (with symbols where the module exports them) on
 * SIGSEGV, SIGBUS, SIGILL, SIGFPE or SIGABRT, then lets the signal end the
 * process as it would have. Resolve offsets with addr2line -e MODULE OFFSET.
 *
 *   cc -shared -fPIC -O1 -o /tmp/crash-backtrace.so scripts/crash-backtrace.c
 *   LD_PRELOAD=/tmp/crash-backtrace.so python3 -c 'import loom; ...'
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <execinfo.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static void on_crash(int sig, siginfo_t *info, void *context) {
  (void)context;
  void *frames[64];
  int n = backtrace(frames, 64);
  char line[512];
  int len = snprintf(line, sizeof line, "crash-backtrace: signal %d (%s) at address %p, %d frames:\n", sig,
                     strsignal(sig), info ? info->si_addr : NULL, n);
  (void)!write(2, line, (size_t)len);
  for (int i = 0; i < n; ++i) {
    Dl_info where;
    if (dladdr(frames[i], &where) && where.dli_fname) {
      len = snprintf(line, sizeof line, "  #%d %s+0x%lx (%s)\n", i, where.dli_fname,
                     (unsigned long)((char *)frames[i] - (char *)where.dli_fbase),
                     where.dli_sname ? where.dli_sname : "?");
    } else {
      len = snprintf(line, sizeof line, "  #%d %p\n", i, frames[i]);
    }
    (void)!write(2, line, (size_t)len);
  }
  signal(sig, SIG_DFL);
  raise(sig);
}

__attribute__((constructor)) static void install(void) {
  struct sigaction a;
  memset(&a, 0, sizeof a);
  a.sa_sigaction = on_crash;
  a.sa_flags = SA_SIGINFO | SA_RESETHAND;
  sigemptyset(&a.sa_mask);
  int signals[] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT};
  for (unsigned i = 0; i < sizeof signals / sizeof *signals; ++i)
    sigaction(signals[i], &a, NULL);
}
