//! `musubi bench dsm-table`: paper 004's Table 3 (messages per page fetch and the messages
//! before the faulting vCPU resumes), measured in the coherence simulator for Ivy and for
//! the paper's asynchronous protocol, printed beside the paper's figures.

use super::driver::{Columns, Outputs};
use super::Harness;
use dsm::table3::Cell;

pub fn run(h: &Harness, _args: &super::BenchArgs) -> Result<(), String> {
    let max_c = if h.quick { 2 } else { 5 };
    let cells = dsm::table3::measure_all(max_c)
        .map_err(|f| format!("a Table 3 scenario failed in the simulator:\n{f}"))?;
    println!("{}", dsm::table3::render());
    let paper = |c: &Cell| dsm::table3::paper(c.protocol, c.access, c.manager, c.c);
    let csv = Columns::new()
        .col("protocol", |c: &&Cell| c.protocol.name().to_string())
        .col("access", |c| c.access.to_string())
        .col("manager", |c| c.manager.name().to_string())
        .col("c", |c| c.c.to_string())
        .col("messages", |c| c.messages.to_string())
        .col("paper_messages", move |c| paper(c).0.to_string())
        .col("to_resume", |c| c.to_resume.to_string())
        .col("paper_path", move |c| paper(c).1.to_string())
        .col("whole_fetch", |c| c.whole.to_string())
        .csv(&cells);
    let p = Outputs::new(h).csv("dsm-table.csv", &csv)?;
    println!("csv: {}", p.display());
    Ok(())
}
