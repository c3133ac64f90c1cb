/* The local sandbox's pid 1 (see backends/sandbox/launcher.py, KEEPALIVE).
 *
 * Says "ready" once it runs inside the finished mount tree, then blocks on its stdin, a pipe
 * only the owner writes to, and exits when the owner closes it. As pid 1 with no signal
 * handlers, no signal from inside reaches it; with SIGCHLD ignored, the kernel reaps every
 * orphan it inherits. Built static, so it runs over any image's libraries.
 */
#include <errno.h>
#include <signal.h>
#include <unistd.h>

int main(void) {
    char buf[256];
    signal(SIGCHLD, SIG_IGN);
    if (write(STDOUT_FILENO, "ready\n", 6) != 6)
        return 1;
    for (;;) {
        ssize_t n = read(STDIN_FILENO, buf, sizeof buf);
        if (n == 0)
            return 0;
        if (n < 0 && errno != EINTR)
            return 1;
    }
}
