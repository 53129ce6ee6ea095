//! The order of the operations within each round of timings.

/// The order of each round of timings, chosen so that what runs right before each operation
/// (whose after-effect on the clock its time carries) is spread over the others as evenly as
/// the rounds allow, counting the step from one round into the next and from the warm-up into
/// the first. Greedy: each position takes, among the operations left in the round, the one that
/// has followed the previous operation least often, then the one least often at this position,
/// then the lowest index; never the previous operation itself. Deterministic (no seed), so runs
/// compared A/B time the same order. A seeded shuffle per round, used before, was not balanced
/// over a few rounds: at `--reps 3` it timed the forward with entropy right after
/// forward+backward in all three rounds (the first after the warm-up's step).
pub struct RoundOrders {
    prev: usize,
    /// `after[p][x]`: how often operation `x` ran right after `p`.
    after: Vec<Vec<u32>>,
    /// `at[x][i]`: how often operation `x` ran at position `i` of a round.
    at: Vec<Vec<u32>>,
}

impl RoundOrders {
    /// `n` operations; `last` ran right before the first round.
    pub fn new(n: usize, last: usize) -> RoundOrders {
        RoundOrders { prev: last, after: vec![vec![0; n]; n], at: vec![vec![0; n]; n] }
    }

    /// The next round: the operations `present` marks, in the order to time them.
    pub fn next(&mut self, present: &[bool]) -> Vec<usize> {
        let mut left: Vec<usize> = (0..present.len()).filter(|&x| present[x]).collect();
        let mut order = Vec::with_capacity(left.len());
        while !left.is_empty() {
            let (p, pos) = (self.prev, order.len());
            let pick = left
                .iter()
                .copied()
                .filter(|&x| x != p || left.len() == 1)
                .min_by_key(|&x| (self.after[p][x], self.at[x][pos], x))
                .expect("an operation is left");
            self.after[p][pick] += 1;
            self.at[pick][pos] += 1;
            self.prev = pick;
            left.retain(|&x| x != pick);
            order.push(pick);
        }
        order
    }
}

#[cfg(test)]
mod tests {
    use super::RoundOrders;

    /// Runs `rounds` rounds of `n` operations (all present) after `last`: the orders and, per
    /// operation, how often each other one ran right before it.
    fn run_rounds(n: usize, rounds: usize, last: usize) -> (Vec<Vec<usize>>, Vec<Vec<u32>>) {
        let mut o = RoundOrders::new(n, last);
        let orders: Vec<Vec<usize>> = (0..rounds).map(|_| o.next(&vec![true; n])).collect();
        let mut before = vec![vec![0u32; n]; n];
        let mut prev = last;
        for x in orders.iter().flatten() {
            before[*x][prev] += 1;
            prev = *x;
        }
        (orders, before)
    }

    #[test]
    fn round_orders_spread_each_predecessor() {
        for n in 1..=10usize {
            for rounds in 1..=3 * n {
                let (orders, before) = run_rounds(n, rounds, n - 1);
                for o in &orders {
                    let mut s = o.clone();
                    s.sort_unstable();
                    assert_eq!(s, (0..n).collect::<Vec<_>>(), "n {n}: {o:?} is not a permutation");
                }
                for (x, b) in before.iter().enumerate() {
                    let others: Vec<u32> = (0..n).filter(|&y| y != x).map(|y| b[y]).collect();
                    if n > 1 {
                        assert_eq!(b[x], 0, "n {n} rounds {rounds}: {x} ran right after itself");
                        let (lo, hi) = (others.iter().min().unwrap(), others.iter().max().unwrap());
                        assert!(hi - lo <= 2, "n {n} rounds {rounds}: before {x}: {b:?}");
                    }
                }
            }
        }
        // The bench's round of one head with the backward (cuBLAS, forward, entropy, step) at
        // --reps 3 after the warm-up's step: each operation after three different ones.
        let (orders, before) = run_rounds(4, 3, 3);
        for (x, b) in before.iter().enumerate() {
            assert!(b.iter().all(|&c| c <= 1), "{x} after {b:?} in {orders:?}");
        }
    }

    #[test]
    fn absent_operations_are_left_out() {
        let mut o = RoundOrders::new(4, 3);
        let full = o.next(&[true; 4]);
        assert_eq!(full.len(), 4);
        for _ in 0..5 {
            let r = o.next(&[true, true, true, false]);
            let mut s = r.clone();
            s.sort_unstable();
            assert_eq!(s, vec![0, 1, 2]);
        }
    }
}
