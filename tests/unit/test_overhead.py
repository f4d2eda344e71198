"""The counters of a node's time outside its engine (node/runtime/overhead.py), fed with made-up clock readings."""

import threading
import time
from collections import Counter

from node.runtime.overhead import Overhead, thread_clock


def test_the_time_between_passes_counts_less_the_wait_for_work():
    o = Overhead(c := Counter())
    o.ran(1.000, 1.010)  # the first pass: nothing before it to measure
    o.ran(1.0115, 1.020)  # 1.5 ms between: all overhead
    o.idle(0.100)
    o.ran(1.1210, 1.130)  # 101 ms between, 100 of them waiting for input
    assert c["outside_passes"] == 2 and c["outside_us_total"] == 2500


def test_a_hop_counts_from_arrival_to_the_pass_that_ran_it_and_from_a_pass_to_its_send():
    o = Overhead(c := Counter())
    o.arrived(2.000)
    o.ran(2.0004, 2.010)
    o.arrived(2.011)  # after the pass began: the next pass's
    assert (c["hop_in"], c["hop_in_us_total"]) == (1, 400)
    o.sent(2.0103, 2.0113)
    assert (c["hop_out"], c["hop_out_us_total"], c["hop_sends"], c["hop_send_us_total"]) == (1, 300, 1, 1000)
    o.ran(2.012, 2.020)
    assert (c["hop_in"], c["hop_in_us_total"]) == (2, 1400)


def test_a_hop_splits_into_the_stages_a_token_lives_in_order():
    o = Overhead(c := Counter())
    o.ran(3.000, 3.010)  # the sending node's pass
    o.applied(3.010, at=3.0102)  # the loop took it up 0.2 ms later
    o.sent(3.0105, answered=3.0125, handed=3.0107)  # called 0.5 ms after the pass, handed to gRPC 0.2 ms later
    assert (c["loop_wakes"], c["loop_wake_us_total"]) == (1, 200)
    assert (c["hop_out"], c["hop_out_us_total"]) == (1, 500)
    assert (c["hop_writes"], c["hop_write_us_total"]) == (1, 200)
    assert (c["hop_sends"], c["hop_send_us_total"]) == (1, 2000)
    # the receiving node: decoded and accepted 0.1 ms after its handler had the message, handed to the engine
    # thread 0.3 ms later, started there 0.2 ms after that
    o.arrived(at=3.0201, received=3.0200)
    o.submitted(at=3.0204)
    o.ran(3.0206, 3.030)
    assert (c["hop_accepts"], c["hop_accept_us_total"]) == (1, 100)
    assert (c["hop_queued"], c["hop_queue_us_total"]) == (1, 300)
    assert (c["engine_wakes"], c["engine_wake_us_total"]) == (1, 200)
    assert (c["hop_in"], c["hop_in_us_total"]) == (1, 500)  # accepted -> started: the queue and the wake


def test_a_pass_the_engine_thread_ran_on_by_itself_has_no_hand_off_to_count():
    o = Overhead(c := Counter())
    o.submitted(at=1.0)
    o.ran(1.0001, 1.010)  # handed over: one wake
    o.ran(1.0105, 1.020)  # run on by the engine thread: nothing was handed to it
    assert (c["engine_wakes"], c["engine_wake_us_total"]) == (1, 100)
    o.submitted(at=1.030)
    o.ran(1.021, 1.029)  # a followed pass the loop applies after the next hand-off: that hand-off is still open
    o.ran(1.0302, 1.040)
    assert (c["engine_wakes"], c["engine_wake_us_total"]) == (2, 300)


def test_cpu_outside_the_engine_is_the_process_cpu_less_the_engine_threads_between_two_passes():
    o = Overhead(c := Counter())
    o.cpu(10.0, 8.0)  # the first reading: nothing before it to measure
    o.cpu(10.012, 8.010)
    assert (c["cpu_passes"], c["cpu_outside_us_total"], c["cpu_engine_us_total"]) == (1, 2000, 10000)


def test_a_threads_clock_counts_only_its_own_cpu_time():
    ident, done = [], threading.Event()

    def sleeper():
        ident.append(threading.get_ident())
        done.wait(5)

    t = threading.Thread(target=sleeper)
    t.start()
    while not ident:
        time.sleep(0.001)
    clock = thread_clock(ident[0])
    before = time.clock_gettime(clock)
    sum(i * i for i in range(200_000))  # this thread's work, not the sleeper's
    assert time.clock_gettime(clock) - before < 0.005
    done.set()
    t.join()
