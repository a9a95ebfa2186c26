package bench

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// clockTicks is USER_HZ, the unit of /proc/<pid>/stat CPU times; it is 100
// on every Linux this runs on.
const clockTicks = 100

// cpuTime is a process's user+system CPU time so far.
func cpuTime(pid int) (time.Duration, error) {
	st, err := readStat(pid)
	return st.cpu, err
}

// peakRSS is a process's peak resident set size (VmHWM) in bytes.
func peakRSS(pid int) (int64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			return kb * 1024, err
		}
	}
	return 0, fmt.Errorf("/proc/%d/status: no VmHWM", pid)
}

// cpuSampler follows a process that may exit at any moment (a walsender
// ends with its client): it samples its CPU time and keeps the last value.
type cpuSampler struct {
	pid  int
	mu   sync.Mutex
	last time.Duration
	stop chan struct{}
	done chan struct{}
}

func sampleCPU(pid int, every time.Duration) *cpuSampler {
	s := &cpuSampler{pid: pid, stop: make(chan struct{}), done: make(chan struct{})}
	s.sample()
	go func() {
		defer close(s.done)
		t := time.NewTicker(every)
		defer t.Stop()
		for {
			select {
			case <-s.stop:
				s.sample()
				return
			case <-t.C:
				if !s.sample() {
					return
				}
			}
		}
	}()
	return s
}

func (s *cpuSampler) sample() bool {
	d, err := cpuTime(s.pid)
	if err != nil {
		return false
	}
	s.mu.Lock()
	s.last = d
	s.mu.Unlock()
	return true
}

// Stop ends sampling and returns the CPU time last seen.
func (s *cpuSampler) Stop() time.Duration {
	select {
	case <-s.done:
	default:
		close(s.stop)
		<-s.done
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.last
}

// selfCPU is this process's user and system CPU time so far.
func selfCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
