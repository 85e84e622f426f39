//! `musubi bench dsm-table`: paper 004's Table 3 (messages per page fetch and the messages
//! before the faulting vCPU resumes), measured in the coherence simulator for Ivy and for
//! the paper's asynchronous protocol, printed beside the paper's figures.

use super::report::Csv;
use super::Harness;

pub fn run(h: &Harness, _args: &super::BenchArgs) -> Result<(), String> {
    let max_c = if h.quick { 2 } else { 5 };
    let cells = dsm::table3::measure_all(max_c)
        .map_err(|f| format!("a Table 3 scenario failed in the simulator:\n{f}"))?;
    println!("{}", dsm::table3::render());
    let mut csv = Csv::new(&[
        "protocol",
        "access",
        "manager",
        "c",
        "messages",
        "paper_messages",
        "to_resume",
        "paper_path",
        "whole_fetch",
    ]);
    for c in &cells {
        let (pm, pp) = dsm::table3::paper(c.protocol, c.access, c.manager, c.c);
        csv.row([
            c.protocol.name().to_string(),
            c.access.to_string(),
            c.manager.name().to_string(),
            c.c.to_string(),
            c.messages.to_string(),
            pm.to_string(),
            c.to_resume.to_string(),
            pp.to_string(),
            c.whole.to_string(),
        ]);
    }
    let p = h.write_csv("dsm-table.csv", &csv)?;
    println!("csv: {}", p.display());
    Ok(())
}
