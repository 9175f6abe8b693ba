/* The lab's fault proxy: a transparent TCP proxy for one link (source host -> destination host).
 *
 * It runs in the source host's network namespace. An nftables rule there redirects the source's connections to the
 * destination host to this proxy's port; the proxy reads each connection's original destination
 * (SO_ORIGINAL_DST), connects to it with its own packets marked (so the rule lets them pass), and relays bytes in
 * both directions: "up" (source -> destination, the requests) and "down" (the answers). Per direction it can
 *
 *   delay   every chunk by delay_us, plus a uniform jitter in [0, jitter_us), order kept;
 *   lose    a chunk with probability loss: what TCP makes of a lost segment, the stream stalls for a retransmission
 *           timeout (rto_ms, 200 by default, Linux's minimum RTO) before that chunk and everything behind it goes on;
 *   blackhole the direction: nothing is read or written and no close is passed on, until it is lifted (the
 *           sender's buffers fill as they would against a silent peer; what was held is delivered after);
 *
 * and reset every connection (both ends get an RST). Sub-millisecond delays need a timer finer than epoll_wait's
 * milliseconds: epoll_pwait2 takes nanoseconds. Written in C because a Python proxy could neither keep 100 us nor
 * carry a data plane's hundreds of MB/s without becoming the bottleneck of the figures it is meant to shape.
 *
 * Control: a Unix stream socket (--control PATH), one line per command, answered by one line:
 *   set up|down|both [delay_us=N] [jitter_us=N] [loss=P] [rto_ms=N] [blackhole=0|1]   -> ok
 *   reset                                                                              -> ok
 *   stats                                                                              -> {"conns":..,...}
 *
 * Usage: lab-proxy --port PORT --mark MARK --control PATH [--seed N]
 * (PORT 0: any free port; prints "ready PORT" once listening)
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/netfilter_ipv4.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#define CHUNK (256 * 1024)
#define MAX_QUEUED (8 * 1024 * 1024) /* per direction of a connection: reading pauses above it */
#define MAX_EVENTS 256

enum { UP = 0, DOWN = 1 };

typedef struct chunk {
    struct chunk *next;
    int64_t due;
    size_t len, off;
    char data[];
} chunk;

typedef struct {
    int64_t delay_ns, jitter_ns, rto_ns;
    double loss;
    int blackhole;
} rule;

struct conn;
typedef struct side {
    int fd;
    struct conn *c;
    int is_b;           /* 0: the source's end (client), 1: the destination's end (server) */
    int eof;            /* read returned 0 */
    int shut;           /* we shut down its write side */
    int need_out;       /* a due chunk did not fit: wait until it is writable */
    uint32_t registered; /* the events it is in epoll for (0: not in epoll) */
} side;

typedef struct conn {
    side a, b;
    chunk *head[2], *tail[2]; /* UP: read from a, written to b; DOWN: read from b, written to a */
    size_t queued[2];
    int64_t last_due[2];
    int connected; /* b's connect finished */
    int dead;
    struct conn *prev, *next;
} conn;

static rule rules[2];
static conn *conns;
static int epfd, lfd, cfd_listen;
static uint32_t mark;
static uint64_t rng = 88172645463325252ULL;
static uint64_t bytes_moved[2], chunks_lost[2], accepted, resets;

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static double uniform(void) { /* xorshift64 */
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (double)(rng >> 11) / 9007199254740992.0;
}

static void die(const char *what) {
    perror(what);
    exit(1);
}

static void set_events(side *s, uint32_t ev) {
    if (s->fd < 0 || s->registered == ev) return;
    if (ev == 0) {
        epoll_ctl(epfd, EPOLL_CTL_DEL, s->fd, NULL);
    } else {
        struct epoll_event e = {.events = ev, .data.ptr = s};
        if (epoll_ctl(epfd, s->registered ? EPOLL_CTL_MOD : EPOLL_CTL_ADD, s->fd, &e) != 0) die("epoll_ctl");
    }
    s->registered = ev;
}

static void free_queue(conn *c, int d) {
    chunk *k = c->head[d];
    while (k) {
        chunk *n = k->next;
        free(k);
        k = n;
    }
    c->head[d] = c->tail[d] = NULL;
    c->queued[d] = 0;
}

static void kill_conn(conn *c, int rst) {
    if (c->dead) return;
    c->dead = 1;
    side *ss[2] = {&c->a, &c->b};
    for (int i = 0; i < 2; i++) {
        if (ss[i]->fd < 0) continue;
        if (rst) {
            struct linger l = {1, 0};
            setsockopt(ss[i]->fd, SOL_SOCKET, SO_LINGER, &l, sizeof l);
        }
        if (ss[i]->registered) epoll_ctl(epfd, EPOLL_CTL_DEL, ss[i]->fd, NULL);
        close(ss[i]->fd);
        ss[i]->fd = -1;
    }
    free_queue(c, UP);
    free_queue(c, DOWN);
    if (c->prev) c->prev->next = c->next; else conns = c->next;
    if (c->next) c->next->prev = c->prev;
    free(c);
}

/* What each side is polled for, from the queues and the rules. A side whose both directions are blackholed is out
 * of epoll altogether: not even its close or reset is noticed (and so not passed on) until the blackhole lifts. */
static void rearm(conn *c) {
    uint32_t ea = 0, eb = 0;
    if (c->connected) {
        if (!rules[UP].blackhole && !c->a.eof && c->queued[UP] < MAX_QUEUED) ea |= EPOLLIN | EPOLLRDHUP;
        if (!rules[DOWN].blackhole && !c->b.eof && c->queued[DOWN] < MAX_QUEUED) eb |= EPOLLIN | EPOLLRDHUP;
        if (c->a.need_out && c->head[DOWN] && !rules[DOWN].blackhole) ea |= EPOLLOUT;
        if (c->b.need_out && c->head[UP] && !rules[UP].blackhole) eb |= EPOLLOUT;
    } else {
        eb = EPOLLOUT; /* the connect's outcome */
    }
    set_events(&c->a, ea);
    set_events(&c->b, eb);
}

/* Write what is due in direction d; -1 when the connection died. */
static int flush(conn *c, int d, int64_t t) {
    side *dst = d == UP ? &c->b : &c->a;
    side *src = d == UP ? &c->a : &c->b;
    if (rules[d].blackhole || !c->connected) return 0;
    dst->need_out = 0;
    while (c->head[d] && c->head[d]->due <= t) {
        chunk *k = c->head[d];
        ssize_t n = send(dst->fd, k->data + k->off, k->len - k->off, MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                dst->need_out = 1;
                return 0;
            }
            kill_conn(c, 1);
            return -1;
        }
        k->off += n;
        bytes_moved[d] += n;
        if (k->off < k->len) {
            dst->need_out = 1;
            return 0;
        }
        c->head[d] = k->next;
        if (!c->head[d]) c->tail[d] = NULL;
        c->queued[d] -= k->len;
        free(k);
    }
    if (!c->head[d] && src->eof && !dst->shut) { /* everything delivered: pass the close on */
        shutdown(dst->fd, SHUT_WR);
        dst->shut = 1;
    }
    if (c->a.shut && c->b.shut) {
        kill_conn(c, 0);
        return -1;
    }
    return 0;
}

static int64_t due_for(int d, int64_t t, conn *c) {
    rule *r = &rules[d];
    int64_t due = t + r->delay_ns;
    if (r->jitter_ns > 0) due += (int64_t)(uniform() * (double)r->jitter_ns);
    if (r->loss > 0 && uniform() < r->loss) {
        due += r->rto_ns;
        chunks_lost[d]++;
    }
    if (due < c->last_due[d]) due = c->last_due[d];
    c->last_due[d] = due;
    return due;
}

/* Read from the source side of direction d into its queue, then write what is due; -1 when the connection died. */
static int fill(conn *c, int d, int64_t t) {
    side *src = d == UP ? &c->a : &c->b;
    while (c->queued[d] < MAX_QUEUED && !rules[d].blackhole && !src->eof) {
        chunk *k = malloc(sizeof(chunk) + CHUNK);
        if (!k) die("malloc");
        ssize_t n = recv(src->fd, k->data, CHUNK, 0);
        if (n <= 0) {
            free(k);
            if (n == 0) {
                src->eof = 1;
                break;
            }
            if (errno == EAGAIN || errno == EWOULDBLOCK) break;
            kill_conn(c, 1);
            return -1;
        }
        if ((size_t)n < CHUNK / 2) { /* do not keep 256 KiB for a few bytes */
            chunk *s = realloc(k, sizeof(chunk) + n);
            if (s) k = s;
        }
        k->len = n;
        k->off = 0;
        k->next = NULL;
        k->due = due_for(d, t, c);
        if (c->tail[d]) c->tail[d]->next = k; else c->head[d] = k;
        c->tail[d] = k;
        c->queued[d] += n;
        if (n < CHUNK) break;
    }
    return flush(c, d, t);
}

static void accept_one(void) {
    struct sockaddr_in orig;
    socklen_t len = sizeof orig;
    int fd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK);
    if (fd < 0) return;
    if (getsockopt(fd, SOL_IP, SO_ORIGINAL_DST, &orig, &len) != 0) {
        close(fd);
        return;
    }
    int b = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    if (b < 0) {
        close(fd);
        return;
    }
    setsockopt(b, SOL_SOCKET, SO_MARK, &mark, sizeof mark);
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    setsockopt(b, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (connect(b, (struct sockaddr *)&orig, sizeof orig) != 0 && errno != EINPROGRESS) {
        struct linger l = {1, 0};
        setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof l);
        close(fd);
        close(b);
        return;
    }
    conn *c = calloc(1, sizeof(conn));
    c->a = (side){.fd = fd, .c = c, .is_b = 0};
    c->b = (side){.fd = b, .c = c, .is_b = 1};
    c->next = conns;
    if (conns) conns->prev = c;
    conns = c;
    accepted++;
    rearm(c);
}

static int parse_dir(const char *w, int *lo, int *hi) {
    if (!strcmp(w, "up")) *lo = *hi = UP;
    else if (!strcmp(w, "down")) *lo = *hi = DOWN;
    else if (!strcmp(w, "both")) { *lo = UP; *hi = DOWN; }
    else return -1;
    return 0;
}

static void command(int fd, char *line) {
    char out[512];
    char *save = NULL, *w = strtok_r(line, " \t\r\n", &save);
    if (!w) return;
    if (!strcmp(w, "set")) {
        int lo, hi;
        char *dir = strtok_r(NULL, " \t\r\n", &save);
        if (!dir || parse_dir(dir, &lo, &hi)) {
            dprintf(fd, "err direction must be up, down or both\n");
            return;
        }
        while ((w = strtok_r(NULL, " \t\r\n", &save))) {
            char *eq = strchr(w, '=');
            if (!eq) { dprintf(fd, "err %s: expected key=value\n", w); return; }
            *eq = 0;
            double v = atof(eq + 1);
            for (int d = lo; d <= hi; d++) {
                if (!strcmp(w, "delay_us")) rules[d].delay_ns = (int64_t)(v * 1000);
                else if (!strcmp(w, "jitter_us")) rules[d].jitter_ns = (int64_t)(v * 1000);
                else if (!strcmp(w, "loss")) rules[d].loss = v;
                else if (!strcmp(w, "rto_ms")) rules[d].rto_ns = (int64_t)(v * 1e6);
                else if (!strcmp(w, "blackhole")) rules[d].blackhole = v != 0;
                else { dprintf(fd, "err unknown setting %s\n", w); return; }
            }
        }
        int64_t t = now_ns();
        for (conn *c = conns, *n; c; c = n) { /* lifted blackholes deliver what they held */
            n = c->next;
            for (int d = 0; d < 2 && !c->dead; d++) if (flush(c, d, t) < 0) break;
            if (!c->dead) rearm(c);
        }
        dprintf(fd, "ok\n");
    } else if (!strcmp(w, "reset")) {
        while (conns) { kill_conn(conns, 1); resets++; }
        dprintf(fd, "ok\n");
    } else if (!strcmp(w, "stats")) {
        int n = 0;
        for (conn *c = conns; c; c = c->next) n++;
        snprintf(out, sizeof out,
                 "{\"conns\": %d, \"accepted\": %llu, \"resets\": %llu, \"bytes_up\": %llu, \"bytes_down\": %llu, "
                 "\"lost_up\": %llu, \"lost_down\": %llu}\n",
                 n, (unsigned long long)accepted, (unsigned long long)resets, (unsigned long long)bytes_moved[UP],
                 (unsigned long long)bytes_moved[DOWN], (unsigned long long)chunks_lost[UP],
                 (unsigned long long)chunks_lost[DOWN]);
        dprintf(fd, "%s", out);
    } else {
        dprintf(fd, "err unknown command %s\n", w);
    }
}

static void control(void) {
    int fd = accept(cfd_listen, NULL, NULL);
    if (fd < 0) return;
    char buf[1024];
    size_t have = 0;
    /* one short-lived connection per request batch: read lines until the peer closes */
    struct timeval tv = {2, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    for (;;) {
        ssize_t n = recv(fd, buf + have, sizeof buf - 1 - have, 0);
        if (n <= 0) break;
        have += n;
        buf[have] = 0;
        char *nl;
        while ((nl = strchr(buf, '\n'))) {
            *nl = 0;
            command(fd, buf);
            size_t rest = have - (nl + 1 - buf);
            memmove(buf, nl + 1, rest);
            have = rest;
            buf[have] = 0;
        }
        if (have == sizeof buf - 1) break;
    }
    close(fd);
}

int main(int argc, char **argv) {
    int port = -1;
    const char *ctl = NULL;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--port")) port = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--mark")) mark = (uint32_t)strtoul(argv[i + 1], NULL, 0);
        else if (!strcmp(argv[i], "--control")) ctl = argv[i + 1];
        else if (!strcmp(argv[i], "--seed")) rng = strtoull(argv[i + 1], NULL, 0) | 1;
        else { fprintf(stderr, "unknown option %s\n", argv[i]); return 2; }
    }
    if (port < 0 || !ctl || !mark) {
        fprintf(stderr, "usage: %s --port PORT --mark MARK --control PATH [--seed N]\n", argv[0]);
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);
    for (int d = 0; d < 2; d++) rules[d].rto_ns = 200 * 1000000LL;
    lfd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    int one = 1;
    setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(port), .sin_addr.s_addr = htonl(INADDR_ANY)};
    if (bind(lfd, (struct sockaddr *)&sa, sizeof sa) || listen(lfd, 512)) die("listen");
    cfd_listen = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un su = {.sun_family = AF_UNIX};
    snprintf(su.sun_path, sizeof su.sun_path, "%s", ctl);
    unlink(ctl);
    if (bind(cfd_listen, (struct sockaddr *)&su, sizeof su) || listen(cfd_listen, 16)) die("control");
    epfd = epoll_create1(0);
    struct epoll_event e = {.events = EPOLLIN, .data.ptr = &lfd};
    epoll_ctl(epfd, EPOLL_CTL_ADD, lfd, &e);
    struct epoll_event ec = {.events = EPOLLIN, .data.ptr = &cfd_listen};
    epoll_ctl(epfd, EPOLL_CTL_ADD, cfd_listen, &ec);
    socklen_t sl = sizeof sa;
    getsockname(lfd, (struct sockaddr *)&sa, &sl);
    printf("ready %d\n", ntohs(sa.sin_port));
    fflush(stdout);
    struct epoll_event evs[MAX_EVENTS];
    for (;;) {
        int64_t t = now_ns(), next = -1;
        for (conn *c = conns; c; c = c->next)
            for (int d = 0; d < 2; d++)
                if (c->head[d] && !rules[d].blackhole && (next < 0 || c->head[d]->due < next)) next = c->head[d]->due;
        struct timespec to, *top = NULL;
        if (next >= 0) {
            int64_t w = next > t ? next - t : 0;
            to.tv_sec = w / 1000000000LL;
            to.tv_nsec = w % 1000000000LL;
            top = &to;
        }
        int n = epoll_pwait2(epfd, evs, MAX_EVENTS, top, NULL);
        if (n < 0 && errno != EINTR) die("epoll");
        t = now_ns();
        for (int i = 0; i < n; i++) {
            if (evs[i].data.ptr == &lfd) { accept_one(); continue; }
            if (evs[i].data.ptr == &cfd_listen) { control(); continue; }
        }
        /* connection events: a connection may have died earlier in this batch, so look each up in the list */
        for (int i = 0; i < n; i++) {
            if (evs[i].data.ptr == &lfd || evs[i].data.ptr == &cfd_listen) continue;
            side *s = evs[i].data.ptr;
            conn *c;
            for (c = conns; c && &c->a != s && &c->b != s; c = c->next) {}
            if (!c) continue;
            uint32_t ev = evs[i].events;
            if (s->is_b && !c->connected) {
                int err = 0;
                socklen_t el = sizeof err;
                getsockopt(s->fd, SOL_SOCKET, SO_ERROR, &err, &el);
                if (err || (ev & (EPOLLERR | EPOLLHUP))) { kill_conn(c, 1); continue; }
                c->connected = 1;
                if (flush(c, UP, t) < 0) continue;
                rearm(c);
                continue;
            }
            if ((ev & EPOLLERR) || ((ev & EPOLLHUP) && !(ev & EPOLLIN))) { kill_conn(c, 1); continue; }
            if ((ev & EPOLLOUT) && flush(c, s->is_b ? UP : DOWN, t) < 0) continue;
            if ((ev & (EPOLLIN | EPOLLRDHUP)) && fill(c, s->is_b ? DOWN : UP, t) < 0) continue;
            rearm(c);
        }
        for (conn *c = conns, *nx; c; c = nx) { /* whatever came due */
            nx = c->next;
            int gone = 0;
            for (int d = 0; d < 2 && !gone; d++)
                if (c->head[d] && c->head[d]->due <= t) gone = flush(c, d, t) < 0;
            if (!gone) rearm(c);
        }
    }
}
