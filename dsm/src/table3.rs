//! placeholder
pub fn render() -> String {
    String::new()
}
