package bench

import (
	"testing"
	"time"
)

func TestParseStat(t *testing.T) {
	// The command name may hold spaces and parentheses; utime, stime,
	// cutime and cstime are fields 14 to 17 in ticks of 10 ms.
	line := "4242 (postgres: a (b) c) S 4000 4000 4000 0 -1 4194560 1 0 0 0 150 50 7 3 20 0 1 0 100 0 0\n"
	st, err := parseStat([]byte(line))
	if err != nil {
		t.Fatal(err)
	}
	if st.ppid != 4000 || st.cpu != 2*time.Second || st.reaped != 100*time.Millisecond || st.started != 100 {
		t.Errorf("parseStat = %+v, want ppid 4000, cpu 2s, reaped 100ms, started 100", st)
	}
	for _, bad := range []string{"", "4242 (x", "4242 (x) S 1 2",
		"4242 (x) S 1 1 1 0 -1 0 0 0 0 0 a 50 7 3 20 0 1 0 100 0 0", // utime
		"4242 (x) S 1 1 1 0 -1 0 0 0 0 0 150 50 7 3 20 0 1 0",       // no starttime
	} {
		if _, err := parseStat([]byte(bad)); err == nil {
			t.Errorf("parseStat(%q): no error", bad)
		}
	}
}

func TestTreeDelta(t *testing.T) {
	ms := func(n int) time.Duration { return time.Duration(n) * time.Millisecond }
	start := treeSnapshot{own: ms(100), reaped: ms(1000), children: map[int]childCPU{
		10: {cpu: ms(500), started: 1},                  // a backend, runs throughout: +200
		11: {cpu: ms(300), started: 1, walsender: true}, // the physical walsender: +50
		12: {cpu: ms(400), started: 5},                  // exits mid-window after +30 (its 430 reaped)
		13: {cpu: ms(900), started: 6, walsender: true}, // exits after +20; pid 13 reused by a walsender that ran 70
		15: {cpu: ms(10), started: 7},                   // exits; pid 15 reused by a busier backend
	}}
	end := treeSnapshot{own: ms(110), reaped: ms(1000 + 430 + 920 + 40), children: map[int]childCPU{
		10: {cpu: ms(700), started: 1},
		11: {cpu: ms(350), started: 1, walsender: true},
		13: {cpu: ms(70), started: 90, walsender: true},
		14: {cpu: ms(25), started: 91, walsender: true}, // started mid-window
		15: {cpu: ms(60), started: 92},
		// and a backend that started and exited mid-window: 40, reaped
	}}
	// The old 15 ran 5 more before its exit: reaped 15.
	end.reaped += ms(15)
	all, ws := treeDelta(start, end)
	// own 10 + 200 + 50 + 30 + (20 + 70) + 25 + (5 + 60) + 40
	if want := ms(10 + 200 + 50 + 30 + 20 + 70 + 25 + 5 + 60 + 40); all != want {
		t.Errorf("all = %v, want %v", all, want)
	}
	// Walsenders alive at the end: 50 + 70 (a new process on a reused
	// pid counts from 0) + 25.
	if want := ms(50 + 70 + 25); ws != want {
		t.Errorf("walsender = %v, want %v", ws, want)
	}
}

func TestIsWalsender(t *testing.T) {
	for cmdline, want := range map[string]bool{
		"postgres: walsender postgres 127.0.0.1(40000) START_REPLICATION\x00": true,
		"postgres: walsender postgres 127.0.0.1(40000) streaming 0/3000060":   true,
		"postgres: postgres bench_1 127.0.0.1(40002) idle\x00":                false,
		"postgres: main: walsender postgres [local] idle":                     true,
		"postgres: main: postgres walsender [local] idle":                     false,
		"postgres: walwriter ": false,
		"/usr/lib/postgresql/17/bin/postgres\x00-D\x00/tmp/x/data\x00": false,
	} {
		if got := isWalsender([]byte(cmdline)); got != want {
			t.Errorf("isWalsender(%q) = %v, want %v", cmdline, got, want)
		}
	}
}
