/* A delay line: every Ethernet frame that arrives on one interface leaves on the other a fixed
 * time later, both ways. The cluster bed runs one per pod link, in a namespace of its own
 * between the pod's veth and the bridge's, because this kernel has no netem qdisc.
 *
 *     delayline IF_A IF_B DELAY_US
 *
 * Raw packet sockets with virtio-net headers: a frame keeps its GSO size and its pending
 * checksum (veths hand local TCP segments on unchecksummed and up to 64 KiB), so nothing
 * has to turn offloads off on the hosts. Frames leave in arrival order, each held from when
 * the line read it. Prints one JSON line once both sockets are bound. Dies with its parent. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <linux/if_ether.h>
#include <linux/if_packet.h>
#include <linux/virtio_net.h>
#include <net/if.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <time.h>

#define MAX_FRAME (sizeof(struct virtio_net_hdr) + 65536 + 256)

struct frame {
	struct frame *next;
	long long due_ns;
	size_t len;
	unsigned char data[];
};

struct queue { struct frame *head, *tail; };

static long long now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int open_port(const char *name)
{
	int fd = socket(AF_PACKET, SOCK_RAW | SOCK_NONBLOCK, htons(ETH_P_ALL));
	int one = 1, rcvbuf = 4 << 20;
	struct sockaddr_ll addr = { .sll_family = AF_PACKET, .sll_protocol = htons(ETH_P_ALL) };
	struct packet_mreq promisc = { .mr_type = PACKET_MR_PROMISC };
	addr.sll_ifindex = promisc.mr_ifindex = (int)if_nametoindex(name);
	if (fd < 0 || addr.sll_ifindex == 0
	    || setsockopt(fd, SOL_PACKET, PACKET_VNET_HDR, &one, sizeof one)
	    /* Frames sent from this namespace (ours) would come back here: not forwarded. */
	    || setsockopt(fd, SOL_PACKET, PACKET_IGNORE_OUTGOING, &one, sizeof one)
	    || setsockopt(fd, SOL_PACKET, PACKET_ADD_MEMBERSHIP, &promisc, sizeof promisc)
	    || setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &rcvbuf, sizeof rcvbuf)
	    || bind(fd, (struct sockaddr *)&addr, sizeof addr)) {
		perror(name);
		exit(1);
	}
	return fd;
}

/* What the socket holds now (64 frames at most, so that sends are never starved), queued
 * with each frame's departure time. */
static void take(int fd, struct queue *q, long long delay_ns, unsigned char *buf)
{
	for (int i = 0; i < 64; i++) {
		ssize_t n = recv(fd, buf, MAX_FRAME, MSG_TRUNC);
		if (n < 0) {
			/* ENETDOWN: a port went down; the socket reports it once and reads on. */
			if (errno == EAGAIN || errno == EINTR || errno == ENETDOWN)
				return;
			perror("recv");
			exit(1);
		}
		if ((size_t)n > MAX_FRAME)
			continue; /* cannot be forwarded whole: lost, as on a wire */
		struct frame *f = malloc(sizeof *f + (size_t)n);
		if (f == NULL)
			continue;
		f->next = NULL;
		f->due_ns = now_ns() + delay_ns;
		f->len = (size_t)n;
		memcpy(f->data, buf, (size_t)n);
		if (q->tail)
			q->tail->next = f;
		else
			q->head = f;
		q->tail = f;
	}
}

/* Sends the frames that are due; the next departure time, or -1 when the queue is empty. */
static long long release(int fd, struct queue *q)
{
	long long now = now_ns();
	while (q->head && q->head->due_ns <= now) {
		struct frame *f = q->head;
		/* A full send queue or a port that is down loses the frame, as a wire would. */
		(void)send(fd, f->data, f->len, MSG_DONTWAIT);
		q->head = f->next;
		if (q->head == NULL)
			q->tail = NULL;
		free(f);
	}
	return q->head ? q->head->due_ns : -1;
}

int main(int argc, char **argv)
{
	if (argc != 4) {
		fprintf(stderr, "usage: %s IF_A IF_B DELAY_US\n", argv[0]);
		return 2;
	}
	prctl(PR_SET_PDEATHSIG, SIGKILL);
	/* Sleeps end within a microsecond of the due time, not the default 50 us later. */
	prctl(PR_SET_TIMERSLACK, 1000UL);
	long long delay_ns = atoll(argv[3]) * 1000LL;
	int fds[2] = { open_port(argv[1]), open_port(argv[2]) };
	struct queue queues[2] = { { 0 } }; /* queues[i]: frames read on fds[i], for the other */
	unsigned char *buf = malloc(MAX_FRAME);
	if (buf == NULL)
		return 1;
	printf("{\"delay_us\": %lld, \"ports\": [\"%s\", \"%s\"]}\n", delay_ns / 1000, argv[1],
	       argv[2]);
	fflush(stdout);
	for (;;) {
		long long next = -1;
		for (int i = 0; i < 2; i++) {
			long long due = release(fds[1 - i], &queues[i]);
			if (due >= 0 && (next < 0 || due < next))
				next = due;
		}
		struct pollfd pfds[2] = { { fds[0], POLLIN, 0 }, { fds[1], POLLIN, 0 } };
		struct timespec wait, *timeout = NULL;
		if (next >= 0) {
			long long left = next - now_ns();
			if (left < 0)
				left = 0;
			wait.tv_sec = left / 1000000000LL;
			wait.tv_nsec = left % 1000000000LL;
			timeout = &wait;
		}
		if (ppoll(pfds, 2, timeout, NULL) < 0 && errno != EINTR) {
			perror("ppoll");
			return 1;
		}
		for (int i = 0; i < 2; i++)
			if (pfds[i].revents)
				take(fds[i], &queues[i], delay_ns, buf);
	}
}
