/* crash-backtrace.c - a native backtrace from a crash, where no debugger is.
 *
 * The GPU machines have no gdb. Preloaded, this prints the crashing thread's
 * stack as module+offset (with symbols where the module exports them) on
 * SIGSEGV, SIGBUS, SIGILL, SIGFPE or SIGABRT, then lets the signal end the
 * process as it would have. Resolve offsets with addr2line -e MODULE OFFSET.
 *
 * SIGUSR2 prints every thread's stack (a hung process: where is each thread?).
 *
 *   cc -shared -fPIC -O1 -o /tmp/crash-backtrace.so scripts/crash-backtrace.c
 *   LD_PRELOAD=/tmp/crash-backtrace.so python3 -c 'import loom; ...'
 *   kill -USR2 PID   # a hung one
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <execinfo.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <dirent.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

static void print_stack(void) {
  void *frames[64];
  int n = backtrace(frames, 64);
  char line[512];
  for (int i = 0; i < n; ++i) {
    Dl_info where;
    int len;
    if (dladdr(frames[i], &where) && where.dli_fname)
      len = snprintf(line, sizeof line, "  #%d %s+0x%lx (%s)\n", i, where.dli_fname,
                     (unsigned long)((char *)frames[i] - (char *)where.dli_fbase),
                     where.dli_sname ? where.dli_sname : "?");
    else
      len = snprintf(line, sizeof line, "  #%d %p\n", i, frames[i]);
    (void)!write(2, line, (size_t)len);
  }
}

static volatile int dumping; /* one thread prints at a time */
static volatile pid_t dump_origin;

/* SIGUSR2: the thread that takes it forwards it to every other thread; each
 * prints its own stack. */
static void on_dump(int sig) {
  (void)sig;
  pid_t self = (pid_t)syscall(SYS_gettid);
  if (__sync_bool_compare_and_swap(&dump_origin, 0, self)) {
    DIR *d = opendir("/proc/self/task");
    struct dirent *e;
    while (d && (e = readdir(d)))
      if (e->d_name[0] != '.' && atoi(e->d_name) != self)
        syscall(SYS_tgkill, getpid(), atoi(e->d_name), SIGUSR2);
    if (d)
      closedir(d);
  }
  while (!__sync_bool_compare_and_swap(&dumping, 0, 1))
    ;
  char line[96];
  int len = snprintf(line, sizeof line, "crash-backtrace: thread %d:\n", (int)self);
  (void)!write(2, line, (size_t)len);
  print_stack();
  __sync_lock_release(&dumping);
}

static void on_crash(int sig, siginfo_t *info, void *context) {
  (void)context;
  char line[512];
  int len = snprintf(line, sizeof line, "crash-backtrace: signal %d (%s) at address %p:\n", sig,
                     strsignal(sig), info ? info->si_addr : NULL);
  (void)!write(2, line, (size_t)len);
  print_stack();
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
  void *warm[1];
  backtrace(warm, 1); /* loads libgcc's unwinder now, not inside a handler */
  struct sigaction d;
  memset(&d, 0, sizeof d);
  d.sa_handler = on_dump;
  d.sa_flags = SA_RESTART;
  sigemptyset(&d.sa_mask);
  sigaction(SIGUSR2, &d, NULL);
}
