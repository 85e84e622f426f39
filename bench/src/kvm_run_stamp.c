/* Musubi's KVM_RUN timing shim, loaded with LD_PRELOAD into any dynamically linked VMM
 * (Musubi and its peers alike) by `musubi bench boot`. It wraps ioctl(2) and, on the
 * process's first KVM_RUN, writes CLOCK_MONOTONIC nanoseconds, in decimal, to the file
 * named by MUSUBI_KVM_RUN_STAMP. The file is opened when the shim loads, before a VMM
 * installs a seccomp filter, so the KVM_RUN path adds only clock_gettime (vDSO) and one
 * write(2). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#define KVM_RUN_REQUEST 0xAE80UL

typedef int (*ioctl_fn)(int, unsigned long, ...);

static ioctl_fn real_ioctl;
static int stamp_fd = -1;
static int stamped;

__attribute__((constructor)) static void stamp_init(void)
{
    const char *path = getenv("MUSUBI_KVM_RUN_STAMP");
    real_ioctl = (ioctl_fn)dlsym(RTLD_NEXT, "ioctl");
    if (path)
        stamp_fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
}

int ioctl(int fd, unsigned long request, ...)
{
    va_list ap;
    void *arg;
    va_start(ap, request);
    arg = va_arg(ap, void *);
    va_end(ap);
    if ((request & 0xFFFFFFFFUL) == KVM_RUN_REQUEST && stamp_fd >= 0 &&
        !__atomic_exchange_n(&stamped, 1, __ATOMIC_SEQ_CST)) {
        struct timespec ts;
        char text[32];
        clock_gettime(CLOCK_MONOTONIC, &ts);
        int n = snprintf(text, sizeof text, "%lld\n",
                         (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec);
        /* Not closed: a filtered VMM thread may be allowed write(2) but not close(2). */
        if (n > 0 && write(stamp_fd, text, (size_t)n) < 0)
            stamped = 1;
    }
    if (!real_ioctl)
        return -1;
    return real_ioctl(fd, request, arg);
}
