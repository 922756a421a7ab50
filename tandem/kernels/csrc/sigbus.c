/* A SIGBUS on a mapped model file, named instead of a silent death.
 *
 * A GGUF file's weights are read through a mapping of the file; when the file is truncated under
 * the process, the next read of a page past its new end raises SIGBUS, which no Python handler
 * can return from (the faulting load would run again). `tandem_watch_mapping` records each
 * mapping's address range and file name and installs this handler once: a SIGBUS whose address
 * lies in a recorded range writes one line naming the file and the byte (write(2) only: async-
 * signal-safe) and ends the process with `code`, which the supervisor names. Any other SIGBUS
 * goes to the handler installed before this one (faulthandler's traceback, or the default).
 */
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#define MAX_MAPPINGS 64
#define NAME_BYTES 1024

static struct {
    uintptr_t lo, hi;
    char name[NAME_BYTES];
} mappings[MAX_MAPPINGS];
static volatile sig_atomic_t n_mappings = 0;
static int exit_code = 85;
static int installed = 0;
static struct sigaction previous;

static void say(const char *s) {
    size_t n = strlen(s);
    while (n > 0) {
        ssize_t w = write(2, s, n);
        if (w <= 0) return;
        s += w;
        n -= (size_t)w;
    }
}

static void say_number(uintptr_t v) {
    char buf[32];
    int i = (int)sizeof buf - 1;
    buf[i] = '\0';
    do {
        buf[--i] = (char)('0' + v % 10);
        v /= 10;
    } while (v > 0 && i > 0);
    say(buf + i);
}

static void on_sigbus(int sig, siginfo_t *info, void *context) {
    (void)context;
    uintptr_t at = (uintptr_t)info->si_addr;
    for (int i = 0; i < n_mappings; i++) {
        if (at >= mappings[i].lo && at < mappings[i].hi) {
            say("tandem: SIGBUS reading the mapped model file ");
            say(mappings[i].name);
            say(" at byte ");
            say_number(at - mappings[i].lo);
            say(": the file was truncated or replaced under this process; exiting with code ");
            say_number((uintptr_t)exit_code);
            say("\n");
            _exit(exit_code);
        }
    }
    /* not a model file's page: the handler before this one takes it (the access runs again) */
    sigaction(sig, &previous, NULL);
}

/* Records [base, base + length) as `name`'s mapping; the first call installs the handler.
 * 0 on success, -1 when the table is full or the handler cannot be installed. */
int tandem_watch_mapping(const void *base, int64_t length, const char *name, int code) {
    int n = n_mappings;
    if (n >= MAX_MAPPINGS || length <= 0) return -1;
    mappings[n].lo = (uintptr_t)base;
    mappings[n].hi = (uintptr_t)base + (uintptr_t)length;
    strncpy(mappings[n].name, name, NAME_BYTES - 1);
    mappings[n].name[NAME_BYTES - 1] = '\0';
    exit_code = code;
    __sync_synchronize(); /* the entry is whole before the handler can see it */
    n_mappings = n + 1;
    if (!installed) {
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_sigaction = on_sigbus;
        sa.sa_flags = SA_SIGINFO;
        sigemptyset(&sa.sa_mask);
        if (sigaction(SIGBUS, &sa, &previous) != 0) return -1;
        installed = 1;
    }
    return 0;
}

/* Forgets every recorded mapping (the handler stays, passing every SIGBUS on). */
void tandem_unwatch_mappings(void) { n_mappings = 0; }
