/* The lab's clock shim: an LD_PRELOAD library giving one process a clock of its own.
 *
 * Why not libfaketime: Debian 12's libfaketime 0.9.10 leaves CPython 3.11 unusable here. Every timed wait of its
 * threading module (Event.wait, Lock.acquire(timeout=...): sem_clockwait on CLOCK_MONOTONIC, which libfaketime does
 * not wrap) hangs once the monotonic clock is faked, and with the monotonic clock left alone every time.sleep
 * fails with EINVAL (its clock_nanosleep(TIMER_ABSTIME) wrapper mixes the clocks). Measured in tests/lab/clock.py.
 *
 * Two settings, in a small file the controller writes (SHARDPS_LAB_CLOCK names it; mapped, so a change shows at the
 * next call):
 *   offset  seconds added to the wall clock (CLOCK_REALTIME and its kin, gettimeofday, time): a step, as NTP makes
 *           one; changeable while the process runs. The monotonic clock does not jump (it never does).
 *   rate    how fast both clocks run from the process's start (2: twice as fast), read once at start: a broken clock
 *           source. Every timed wait follows the process's clock: an absolute deadline on either clock is mapped to
 *           the real clock, a relative timeout divided by the rate (sleeps, condition variables, semaphores, poll,
 *           select, epoll), so "wait 1 s" lasts 1 s of the process's clock.
 *
 * File layout (little endian): int64 offset_ns, double rate, uint64 seq (a seqlock: odd while being written).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <semaphore.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/mman.h>
#include <sys/select.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

struct settings {
    volatile int64_t offset_ns;
    volatile double rate;
    volatile uint64_t seq;
};

static struct settings *S;
static double RATE = 1.0;
static int64_t T0_MONO; /* real monotonic time at load: where the rate applies from */

static int64_t ns_of(const struct timespec *ts) { return (int64_t)ts->tv_sec * 1000000000LL + ts->tv_nsec; }
static struct timespec ts_of(int64_t ns) {
    struct timespec ts;
    if (ns < 0) ns = 0;
    ts.tv_sec = ns / 1000000000LL;
    ts.tv_nsec = ns % 1000000000LL;
    return ts;
}

/* The real clocks, straight from the kernel (never through this library). */
static int64_t real_ns(clockid_t clk) {
    struct timespec ts;
    syscall(SYS_clock_gettime, clk, &ts);
    return ns_of(&ts);
}

static int64_t offset(void) {
    if (!S) return 0;
    for (;;) {
        uint64_t a = __atomic_load_n(&S->seq, __ATOMIC_ACQUIRE);
        int64_t off = S->offset_ns;
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        if (!(a & 1) && a == __atomic_load_n(&S->seq, __ATOMIC_ACQUIRE)) return off;
    }
}

__attribute__((constructor)) static void setup(void) {
    T0_MONO = real_ns(CLOCK_MONOTONIC);
    const char *path = getenv("SHARDPS_LAB_CLOCK");
    if (!path) return;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return;
    void *p = mmap(NULL, sizeof(struct settings), PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) return;
    S = p;
    RATE = S->rate > 0 ? S->rate : 1.0;
}

static int is_wall(clockid_t clk) {
    return clk == CLOCK_REALTIME || clk == CLOCK_REALTIME_COARSE || clk == CLOCK_TAI || clk == CLOCK_REALTIME_ALARM;
}
static int is_mono(clockid_t clk) {
    return clk == CLOCK_MONOTONIC || clk == CLOCK_MONOTONIC_RAW || clk == CLOCK_MONOTONIC_COARSE ||
           clk == CLOCK_BOOTTIME || clk == CLOCK_BOOTTIME_ALARM;
}

/* The process's time on ``clk`` when the real clock reads ``real``. */
static int64_t fake(clockid_t clk, int64_t real) {
    if (is_mono(clk)) return RATE == 1.0 ? real : T0_MONO + (int64_t)((double)(real - T0_MONO) * RATE);
    if (is_wall(clk)) {
        int64_t drift = RATE == 1.0 ? 0 : (int64_t)((double)(real_ns(CLOCK_MONOTONIC) - T0_MONO) * (RATE - 1.0));
        return real + offset() + drift;
    }
    return real;
}

/* An absolute deadline on the process's ``clk`` as the real clock's. */
static int64_t real_deadline(clockid_t clk, int64_t fake_abs) {
    if (!is_mono(clk) && !is_wall(clk)) return fake_abs;
    int64_t now = real_ns(clk);
    return now + (int64_t)((double)(fake_abs - fake(clk, now)) / RATE);
}

static int64_t scaled(int64_t ns) { return RATE == 1.0 ? ns : (int64_t)((double)ns / RATE); }
static int scaled_ms(int ms) {
    if (ms <= 0 || RATE == 1.0) return ms;
    int64_t out = (int64_t)((double)ms / RATE);
    return out < 1 ? 1 : (int)out;
}

#define REAL(ret, name, ...)                                        \
    static ret (*real_##name)(__VA_ARGS__);                          \
    if (!real_##name) real_##name = dlsym(RTLD_NEXT, #name)

int clock_gettime(clockid_t clk, struct timespec *ts) {
    if (syscall(SYS_clock_gettime, clk, ts) != 0) return -1;
    if (is_mono(clk) || is_wall(clk)) *ts = ts_of(fake(clk, ns_of(ts)));
    return 0;
}

int gettimeofday(struct timeval *restrict tv, void *restrict tz) {
    (void)tz;
    if (!tv) return 0;
    int64_t ns = fake(CLOCK_REALTIME, real_ns(CLOCK_REALTIME));
    tv->tv_sec = ns / 1000000000LL;
    tv->tv_usec = (ns % 1000000000LL) / 1000;
    return 0;
}

time_t time(time_t *t) {
    time_t now = (time_t)(fake(CLOCK_REALTIME, real_ns(CLOCK_REALTIME)) / 1000000000LL);
    if (t) *t = now;
    return now;
}

int clock_nanosleep(clockid_t clk, int flags, const struct timespec *req, struct timespec *rem) {
    REAL(int, clock_nanosleep, clockid_t, int, const struct timespec *, struct timespec *);
    struct timespec r;
    if (flags & TIMER_ABSTIME) {
        r = ts_of(real_deadline(clk, ns_of(req)));
        clockid_t real_clk = is_wall(clk) ? CLOCK_REALTIME : is_mono(clk) ? CLOCK_MONOTONIC : clk;
        return real_clock_nanosleep(real_clk, flags, &r, rem);
    }
    r = ts_of(scaled(ns_of(req)));
    return real_clock_nanosleep(clk, flags, &r, rem);
}

int nanosleep(const struct timespec *req, struct timespec *rem) {
    REAL(int, nanosleep, const struct timespec *, struct timespec *);
    struct timespec r = ts_of(scaled(ns_of(req)));
    return real_nanosleep(&r, rem);
}

int sem_clockwait(sem_t *sem, clockid_t clk, const struct timespec *abs) {
    REAL(int, sem_clockwait, sem_t *, clockid_t, const struct timespec *);
    struct timespec r = ts_of(real_deadline(clk, ns_of(abs)));
    return real_sem_clockwait(sem, clk, &r);
}

int sem_timedwait(sem_t *restrict sem, const struct timespec *restrict abs) {
    REAL(int, sem_timedwait, sem_t *, const struct timespec *);
    struct timespec r = ts_of(real_deadline(CLOCK_REALTIME, ns_of(abs)));
    return real_sem_timedwait(sem, &r);
}

int pthread_cond_clockwait(pthread_cond_t *cond, pthread_mutex_t *mutex, clockid_t clk, const struct timespec *abs) {
    REAL(int, pthread_cond_clockwait, pthread_cond_t *, pthread_mutex_t *, clockid_t, const struct timespec *);
    struct timespec r = ts_of(real_deadline(clk, ns_of(abs)));
    return real_pthread_cond_clockwait(cond, mutex, clk, &r);
}

int pthread_cond_timedwait(pthread_cond_t *restrict cond, pthread_mutex_t *restrict mutex,
                           const struct timespec *restrict abs) {
    static int (*real_timedwait)(pthread_cond_t *, pthread_mutex_t *, const struct timespec *);
    if (!real_timedwait) { /* the current symbol version, not the 2.2.5 compatibility one dlsym would find */
        real_timedwait = dlvsym(RTLD_NEXT, "pthread_cond_timedwait", "GLIBC_2.3.2");
        if (!real_timedwait) real_timedwait = dlsym(RTLD_NEXT, "pthread_cond_timedwait");
    }
    /* glibc keeps a condition variable's clock in bit 1 of __wrefs (pthread_condattr_setclock) */
    clockid_t clk = (cond->__data.__wrefs & 2) ? CLOCK_MONOTONIC : CLOCK_REALTIME;
    struct timespec r = ts_of(real_deadline(clk, ns_of(abs)));
    return real_timedwait(cond, mutex, &r);
}

int poll(struct pollfd *fds, nfds_t n, int timeout) {
    REAL(int, poll, struct pollfd *, nfds_t, int);
    return real_poll(fds, n, scaled_ms(timeout));
}

int ppoll(struct pollfd *fds, nfds_t n, const struct timespec *to, const sigset_t *mask) {
    REAL(int, ppoll, struct pollfd *, nfds_t, const struct timespec *, const sigset_t *);
    if (!to) return real_ppoll(fds, n, to, mask);
    struct timespec r = ts_of(scaled(ns_of(to)));
    return real_ppoll(fds, n, &r, mask);
}

int epoll_wait(int epfd, struct epoll_event *events, int max, int timeout) {
    REAL(int, epoll_wait, int, struct epoll_event *, int, int);
    return real_epoll_wait(epfd, events, max, scaled_ms(timeout));
}

int epoll_pwait(int epfd, struct epoll_event *events, int max, int timeout, const sigset_t *mask) {
    REAL(int, epoll_pwait, int, struct epoll_event *, int, int, const sigset_t *);
    return real_epoll_pwait(epfd, events, max, scaled_ms(timeout), mask);
}

int select(int n, fd_set *r, fd_set *w, fd_set *e, struct timeval *to) {
    REAL(int, select, int, fd_set *, fd_set *, fd_set *, struct timeval *);
    if (!to || RATE == 1.0) return real_select(n, r, w, e, to);
    int64_t us = scaled(((int64_t)to->tv_sec * 1000000LL + to->tv_usec) * 1000) / 1000;
    struct timeval t = {us / 1000000LL, us % 1000000LL};
    return real_select(n, r, w, e, &t);
}
